"""A transformers-backed stand-in for vLLM serving a vision-language model (the tiny VLMs of models/tiny_vlm.py:
Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE), for tests only:
vLLM's CPU build cannot serve Qwen3-VL here (it needs torchvision, which only has CUDA builds; docs/vlm.md).

It serves the surface the orchestrator uses, in vLLM's shapes: chat completions (whole or streamed) with
`return_token_ids` and per-token `logprobs`, prompt scoring (`/v1/completions` with `prompt_logprobs`, the weight
check), /pause, /resume, /reset_prefix_cache, /metrics, /weight_info and the filesystem weight update
(/start_weight_update, /update_weights with a published folder, /finish_weight_update). Every token is sampled from the real model and every
log-prob is the real model's, at the request's temperature (vLLM's `processed_logprobs`), in the served dtype
(bfloat16 by default, like vLLM serving model.dtype). Prompts are rendered as vLLM renders them: each image's
placeholder expanded to one `<|image_pad|>` per merged patch (models/vlm_inputs.py).

One model forward at a time (a lock), recomputing the whole sequence per token (no KV cache: tiny models only).
/pause waits until the requests in flight have sent their last token, so every token is sent before new weights load.
Run: `python -m slipstream_sim.vlm_server --model DIR --port PORT`.
"""

import argparse
import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from slipstream.inference.instance import InstanceIdMiddleware, new_instance_id
from slipstream.launch.watchdog import start_from_env
from slipstream.models.vlm_inputs import render_image_prompt
from slipstream.utils.images import message_images


class RequestError(ValueError):
    """What vLLM would refuse with HTTP 400."""


@dataclass
class Choice:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class VLMEngine:
    """The model, its tokenizer and image processor, and the served policy version."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()
        eos = self.model.generation_config.eos_token_id
        config = self.model.config
        # A sampled image or video placeholder ends the completion: transformers' forward would take it for an
        # image's token (vLLM embeds it as text); the orchestrator drops such samples (batch/dropped_image_samples).
        self.stop_ids = set(eos if isinstance(eos, list) else [eos]) | {config.image_token_id, config.video_token_id}
        self.stop_ids.discard(None)
        self.filler_id = min(self.stop_ids - {config.image_token_id, config.video_token_id})
        self.seed, self.version, self.loads, self.num_requests = seed, 0, [], 0
        self.lock = threading.Lock()

    def render(self, messages: Any) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Prompt token ids (image placeholders expanded) and the model's image inputs ({} without images)."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list")
        try:
            if not message_images(messages):
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                return self.tokenizer(text, add_special_tokens=False)["input_ids"], {}
            prompt = render_image_prompt(self.tokenizer, self.image_processor, messages)
        except (ValueError, KeyError, TypeError) as e:
            raise RequestError(f"cannot render the messages: {e}") from e
        return prompt.token_ids, {"pixel_values": prompt.pixel_values_PF, "image_grid_thw": prompt.image_grid_thw_I3}

    @torch.no_grad()
    def logits(self, ids_BL: torch.Tensor, images: dict[str, torch.Tensor]) -> torch.Tensor:
        """logits_BLV (float32) of rows that all hold the same images (each row gets its own copy of them)."""
        num_rows = ids_BL.shape[0]
        inputs: dict[str, Any] = {"input_ids": ids_BL, "use_cache": False}
        if images:
            inputs["pixel_values"] = torch.cat([images["pixel_values"]] * num_rows).to(self.model.dtype)
            inputs["image_grid_thw"] = images["image_grid_thw"].repeat(num_rows, 1)
            inputs["mm_token_type_ids"] = (ids_BL == self.model.config.image_token_id).int()
        return self.model(**inputs).logits.float()

    def generate(
        self, prompt_ids: list[int], images: dict, n: int, max_tokens: int, temperature: float, seed: int | None
    ) -> list[Choice]:
        """`n` completions sampled from softmax(logits / temperature) (greedy at 0), each token's log-prob under
        that distribution (log_softmax of the raw logits at temperature 0); a completion ends at EOS (or at a
        sampled vision placeholder)."""
        with self.lock:
            # A request's `seed` makes its samples reproducible; without one every request draws afresh.
            self.num_requests += 1
            request_seed = seed if seed is not None else self.num_requests + (1 << 40)
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + request_seed)
            ids_BL = torch.tensor([prompt_ids] * n)
            choices = [Choice([], [], "length") for _ in range(n)]
            for _ in range(max_tokens):
                logits_BV = self.logits(ids_BL, images)[:, -1]
                logprobs_BV = torch.log_softmax(logits_BV / temperature if temperature > 0 else logits_BV, -1)
                if temperature > 0:
                    next_B = torch.multinomial(logprobs_BV.exp(), 1, generator=generator)[:, 0]
                else:
                    next_B = logits_BV.argmax(-1)
                for b, choice in enumerate(choices):
                    if choice.finish_reason == "length":  # not ended yet
                        token = int(next_B[b])
                        choice.token_ids.append(token)
                        choice.logprobs.append(float(logprobs_BV[b, token]))
                        if token in self.stop_ids:
                            choice.finish_reason = "stop"
                if all(c.finish_reason == "stop" for c in choices):
                    break
                # Ended rows go on with a filler token (their outputs are unused), never with a placeholder.
                ended_B = torch.tensor([c.finish_reason == "stop" for c in choices])
                next_B = torch.where(ended_B, self.filler_id, next_B)
                ids_BL = torch.cat([ids_BL, next_B[:, None]], dim=1)
        return choices

    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token i | tokens before it) at temperature 1 for i >= 1 (a text prompt)."""
        with self.lock:
            logits_LV = self.logits(torch.tensor([token_ids]), {})[0]
        logprobs_L = torch.log_softmax(logits_LV[:-1], -1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
        return logprobs_L.tolist()

    def load(self, folder: Path) -> None:
        """Load a published weights folder (its safetensors files, the checkpoint's own names and layout) in place.
        The tensors go through transformers' loader (`from_pretrained` with the served model's config), which converts
        a checkpoint's layout into the model's (MoE experts: per-expert or transposed in the checkpoint, fused in the
        model); every parameter must come from the folder."""
        from transformers import AutoModelForImageTextToText

        if not (folder / "READY").exists() or not any(folder.glob("*.safetensors")):
            raise RequestError(f"{folder} is not a complete published weights folder (no READY marker or tensors)")
        loaded, info = AutoModelForImageTextToText.from_pretrained(
            folder, config=self.model.config, generation_config=self.model.generation_config, dtype=self.model.dtype,
            output_loading_info=True,
        )  # fmt: skip
        wrong = {kind: list(info[kind])[:5] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if any(wrong.values()):
            raise RequestError(f"{folder} does not hold this model's tensors: {wrong}")
        with self.lock:
            self.model.load_state_dict(loaded.state_dict(), strict=True)
        self.loads.append(str(folder))


def _error(status: int, message: str) -> JSONResponse:
    body = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status}
    return JSONResponse(body, status_code=status)


def _int(body: dict, name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
        raise RequestError(f"'{name}' must be an integer >= {minimum}, got {value!r}")
    return value


def _sampling(body: dict) -> tuple[int, int, float, int | None]:
    """(n, max_tokens, temperature, seed) of a request; top_p and top_k other than off are refused (not served)."""
    if body.get("top_p", 1.0) != 1.0 or body.get("top_k", -1) not in (-1, 0, None):
        raise RequestError("the VLM stand-in samples the full distribution only: top_p = 1 and no top_k")
    temperature = body.get("temperature", 1.0)
    if not isinstance(temperature, int | float) or temperature < 0:
        raise RequestError(f"'temperature' must be a number >= 0, got {temperature!r}")
    max_tokens = _int(body, "max_completion_tokens", body.get("max_tokens"), 1) or 16
    return _int(body, "n", 1, 1), max_tokens, float(temperature), _int(body, "seed", None, 0)


class VLMServer:
    """The HTTP surface (Starlette app `app`) over a VLMEngine."""

    def __init__(self, engine: VLMEngine) -> None:
        self.engine = engine
        self.active_update = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.num_in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._ids = 0
        self.weight_version = "default"
        """vLLM's /weight_info: "default" until the first finished update, then that update's weight_version."""
        post = {
            "/v1/chat/completions": self.chat,
            "/v1/completions": self.completions,
            "/pause": self.pause,
            "/resume": self.resume,
            "/reset_prefix_cache": self.reset_prefix_cache,
            "/start_weight_update": self.start_weight_update,
            "/update_weights": self.update_weights,
            "/finish_weight_update": self.finish_weight_update,
            "/init_weight_transfer_engine": self.init_weight_transfer,
        }
        routes = [Route(path, self._guarded(handler), methods=["POST"]) for path, handler in post.items()]
        routes += [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/get_world_size", self.get_world_size, methods=["GET"]),
            Route("/weight_info", self.weight_info, methods=["GET"]),
        ]
        instance = InstanceIdMiddleware  # a restart is a new instance, as with `slipstream inference`
        self.app = Starlette(routes=routes, middleware=[Middleware(instance, instance=new_instance_id())])

    @staticmethod
    def _guarded(handler):
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestError as e:
                return _error(400, str(e))

        return run

    async def _body(self, request: Request) -> dict:
        try:
            body = await request.json() if await request.body() else {}
        except ValueError as e:
            raise RequestError(f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        return body

    def _begin(self) -> None:
        self.num_in_flight += 1
        self.idle.clear()

    def _end(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self.idle.set()

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        waiting = 0 if self.resumed.is_set() else 1
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="vlm"}} {float(self.num_in_flight)}',
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{model_name="vlm"}} {float(waiting)}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def get_world_size(self, request: Request) -> Response:
        return JSONResponse({"world_size": 1})

    async def weight_info(self, request: Request) -> Response:
        return JSONResponse({"weight_version": self.weight_version})

    async def chat(self, request: Request) -> Response:
        body = await self._body(request)
        n, max_tokens, temperature, seed = _sampling(body)
        prompt_ids, images = self.engine.render(body.get("messages"))
        await self.resumed.wait()
        self._begin()
        try:
            args = (prompt_ids, images, n, max_tokens, temperature, seed)
            choices = await asyncio.to_thread(self.engine.generate, *args)
        except BaseException:
            self._end()
            raise
        self._ids += 1
        envelope = {"id": f"chatcmpl-vlm-{self._ids}", "model": body.get("model"), "created": int(time.time())}
        if body.get("stream"):
            return StreamingResponse(self._stream(envelope, body, prompt_ids, choices), media_type="text/event-stream")
        self._end()
        reply = envelope | {
            "object": "chat.completion",
            "choices": [self._choice(i, c, body) for i, c in enumerate(choices)],
            "usage": _usage(prompt_ids, choices),
        }
        if body.get("return_token_ids"):
            reply["prompt_token_ids"] = prompt_ids
        return JSONResponse(reply)

    def _text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}

    def _choice(self, index: int, choice: Choice, body: dict) -> dict:
        out: dict[str, Any] = {
            "index": index,
            # as vLLM (skip_special_tokens): a sampled vision placeholder that ended the completion is no text, so a
            # later turn's prompt holds one placeholder per image
            "message": {
                "role": "assistant",
                "content": self.engine.tokenizer.decode(choice.token_ids, skip_special_tokens=True),
            },
            "logprobs": None,
            "finish_reason": choice.finish_reason,
            "stop_reason": None,
        }
        if body.get("logprobs"):
            pairs = zip(choice.token_ids, choice.logprobs, strict=True)
            out["logprobs"] = {"content": [self._entry(t, lp) for t, lp in pairs]}
        if body.get("return_token_ids"):
            out["token_ids"] = choice.token_ids
        return out

    async def _stream(self, envelope: dict, body: dict, prompt_ids: list[int], choices: list[Choice]) -> AsyncIterator:
        """vLLM's chunks: roles (with the prompt's token ids), one chunk per token, usage, [DONE]."""

        def chunk(parts: list[dict], **fields: Any) -> str:
            return f"data: {json.dumps(envelope | {'object': 'chat.completion.chunk', 'choices': parts} | fields)}\n\n"

        try:
            first = {"prompt_token_ids": prompt_ids} if body.get("return_token_ids") else {}
            roles = [{"index": i, "delta": {"role": "assistant", "content": ""}} for i in range(len(choices))]
            yield chunk(roles, **first)
            for index, choice in enumerate(choices):
                for k, (token, logprob) in enumerate(zip(choice.token_ids, choice.logprobs, strict=True)):
                    content = self.engine.tokenizer.decode([token], skip_special_tokens=True)  # as vLLM's deltas
                    part: dict[str, Any] = {"index": index, "delta": {"content": content}}
                    part["finish_reason"] = choice.finish_reason if k == len(choice.token_ids) - 1 else None
                    if body.get("logprobs"):
                        part["logprobs"] = {"content": [self._entry(token, logprob)]}
                    if body.get("return_token_ids"):
                        part["token_ids"] = [token]
                    yield chunk([part])
            if (body.get("stream_options") or {}).get("include_usage"):
                yield chunk([], usage=_usage(prompt_ids, choices))
            yield "data: [DONE]\n\n"
        finally:
            self._end()

    async def completions(self, request: Request) -> Response:
        """Prompt scoring: token ids in, `prompt_logprobs` out (plus real sampled tokens as the completion)."""
        body = await self._body(request)
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(t, int) and t >= 0 for t in prompt)):
            raise RequestError("'prompt' must be a list of at least 2 token ids (the stand-in scores token prompts)")
        n, _, temperature, seed = _sampling(body)
        max_tokens = _int(body, "max_tokens", 1, 1)
        await self.resumed.wait()
        logprobs = await asyncio.to_thread(self.engine.score, prompt)
        choices = await asyncio.to_thread(self.engine.generate, prompt, {}, n, max_tokens, temperature, seed)
        out = []
        for i, choice in enumerate(choices):
            entry = {"index": i, "text": self.engine.tokenizer.decode(choice.token_ids, skip_special_tokens=True)}
            entry |= {"finish_reason": choice.finish_reason, "logprobs": None, "stop_reason": None}
            if body.get("prompt_logprobs") is not None:
                entry["prompt_logprobs"] = [None] + [
                    {str(t): {"logprob": lp, "rank": 1, "decoded_token": self._text(t)}}
                    for t, lp in zip(prompt[1:], logprobs, strict=True)
                ]
            out.append(entry)
        reply = {"id": "cmpl-vlm", "object": "text_completion", "model": body.get("model"), "choices": out}
        return JSONResponse(reply | {"usage": _usage(prompt, choices)})

    async def pause(self, request: Request) -> Response:
        self.resumed.clear()
        await self.idle.wait()  # every token of the requests in flight is sent before weights change
        return JSONResponse({"status": "paused"})

    async def resume(self, request: Request) -> Response:
        self.resumed.set()
        return JSONResponse({"status": "resumed"})

    async def reset_prefix_cache(self, request: Request) -> Response:
        return JSONResponse({"success": True})  # no cache to reset

    async def init_weight_transfer(self, request: Request) -> Response:
        raise RequestError("the VLM stand-in loads published folders only: set weights.transport = 'filesystem'")

    async def start_weight_update(self, request: Request) -> Response:
        if self.active_update:
            raise RequestError("start_weight_update called while a weight update is already active")
        if self.resumed.is_set():
            raise RequestError("weight update while generation is running; call POST /pause first")
        self.active_update = True
        return JSONResponse({"message": "Weight update started"})

    async def update_weights(self, request: Request) -> Response:
        info = (await self._body(request)).get("update_info")
        if not self.active_update:
            raise RequestError("start_weight_update must be called before update_weights")
        if not isinstance(info, dict) or not isinstance(info.get("path"), str):
            raise RequestError(f"update_info must name a published folder ('path'), got {info!r:.200}")
        await asyncio.to_thread(self.engine.load, Path(info["path"]))
        return JSONResponse({"message": "Weights updated"})

    async def finish_weight_update(self, request: Request) -> Response:
        version = (await self._body(request)).get("weight_version")
        if not self.active_update:
            raise RequestError("finish_weight_update called without a matching start_weight_update")
        self.active_update = False
        if version is not None and str(version).isdigit():
            self.engine.version = int(version)
        self.weight_version = str(version)
        return JSONResponse({"message": "Weight update finished"})


def _usage(prompt_ids: list[int], choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
    }


def main(argv: list[str] | None = None) -> int:
    start_from_env()  # under `slipstream rl`, exit with the launcher
    parser = argparse.ArgumentParser(prog="python -m slipstream_sim.vlm_server", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face folder of the vision-language model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="served dtype")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled tokens")
    parser.add_argument("--num-threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    engine = VLMEngine(args.model, getattr(torch, args.dtype), args.seed)
    print(f"VLM stand-in serving {args.model} ({args.dtype}) on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(VLMServer(engine).app, host=args.host, port=args.port, log_level="warning", lifespan="off")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
