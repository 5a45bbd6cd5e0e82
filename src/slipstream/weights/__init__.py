"""The weight path: one policy version from the trainer's optimizer to the parameters of vLLM's model.

Dataflow of version N (the policy after trainer step N; version 0 is the starting model):

    trainer ranks: FSDP2 / EP shards of the float32 masters
      send/export.py        the model as a *stream* of Hugging Face tensors, layer by layer (names from the family's
                            adapter, experts unstacked, LoRA folded in); its metadata (names, dtypes, shapes) first
      send/shard_gather.py  sharded tensors cast to the published dtype and all-gathered a chunk of layers at a time
      wire/stream.py        the *bucket* plan (from metadata alone, so both sides agree before a byte moves) and the
                            *manifest* that carries it
      wire/bucket_assembly.py  runs copied (and cast) into reused bucket buffers; each complete bucket to the sinks
      send/piece_send.py    or, when the sharding allows, every rank casts its own rows: its *piece* of each bucket
      send/changes.py       (`weights.track_changes`) what changed since the version before, as a delta would send it
      send/delta_send.py    (`weights.delta`, gloo) each bucket as its changed elements or whole, whichever is smaller,
                            with a checksum (wire/delta.py); flagged buckets again whole in the repair round
      send/publish.py       *publish* by `weights.transport`:
        filesystem          safetensors shards + config + probe.json + READY in `weights/step_N/` (send/folder.py)
        nccl / gloo         *offer* (wire/offers.py); the orchestrator ACCEPTs it for a *session*; once every
                            receiver marked it is about to receive (wire/collective.py), one broadcast per bucket
                            from rank 0, or one per sender and bucket, each on its *lane* (wire/collective.py,
                            wire/pieces.py), the first buckets cast during that wait (send/piece_send.py prepare);
                            send/send_watch.py waits for the sends without hanging on a dead receiver
        ipc                 the buckets laid out in a buffer shared with inference (wire/shared_buffer.py), offered
                            with its handle; DELIVERED frees it for the next version
    orchestrator (orchestrator/weight_loads.py, outside this package: it moves no tensor): pauses vLLM and drives vLLM's
      weight-transfer API (/init_weight_transfer_engine per session, /update_weights with the folder or the manifest);
      `weights.no_stall` (an open session's broadcast): no pause; /start_weight_update, ACCEPT, /update_weights with
      `stage`, the trainer's DELIVERED awaited while vLLM generates, then /finish_weight_update swaps the version in
    each vLLM worker
      receive/engine.py     vLLM's weight-transfer engine `slipstream` (registered by inference/vllm_plugin.py)
      receive/receiver.py   joins the session, takes the version from the folder, the broadcast or the shared buffer
      receive/bucket_receive.py  receives bucket k+1 while bucket k is loaded; lays several senders' pieces out whole
      receive/delta_receive.py   a delta onto the *mirror* of the version before, checked, then the whole bucket loads
      receive/staging.py    (`weights.no_stall`) a background thread receives the version into *staging* memory (a
                            buffer per bucket, or the delta mirror) while vLLM generates; the engine's finish swaps it in
      receive/copy_plan.py  the first version goes through vLLM's loaders, watched (receive/load_recorder.py); when
                            they only copied, later versions replay the *copy plan* into the parameters
      receiver.check_loaded every tensor of the version reached the loader, else the update fails (HTTP 500)
    orchestrator (orchestrator/weight_check.py): scores the trainer's probe on inference and compares log-probs

Glossary (the words of this package, as the code uses them):
- version: the weights after trainer step N, published once; every generated token records the version behind it.
- stream: the model's tensors in Hugging Face names, in a fixed order, yielded layer by layer as *runs* (one tensor,
  or a layer's experts of one projection stacked) on every trainer rank in lockstep (its gathers are collectives).
- bucket: tensors of one dtype that travel as one flat byte buffer, in plan order; at most `weights.bucket_mb` unless
  one tensor is larger. The plan is computed from the stream's metadata, so sender and receivers agree on every byte.
- manifest: a version's step, bucket plan and number of senders (JSON in `/update_weights` and `manifest.json`).
- sink: where a sender's complete buckets go: safetensors shards, a broadcast, the shared buffer.
- piece: what sender q sends of a bucket when every trainer rank sends the rows it holds: tensor after tensor, its rows
  of that tensor. On the wire a bucket is piece 0, piece 1, ...; receivers lay it out whole, or a copy plan reads the
  pieces where they arrived.
- lane: with several senders, sender q's own process group with every receiver, so the pieces travel side by side on
  separate communicators; with one sender the session has one group.
- session: one life of the receiving side: a group (or lanes) built under its own prefix of the trainer's store; the
  orchestrator opens a new one when inference restarts or the number of senders changes.
- offer: the trainer's `weights/step_N/` holding manifest.json, probe.json and OFFER (transport, senders, the shared
  buffer's handle): the version waits there to be ACCEPTed for a session, then is marked DELIVERED.
- publish: what the trainer does after every step: write the folder, or offer and send (LoRA: a PEFT adapter folder).
- published folder: `weights/step_N/` complete with its READY marker (wire/published.py reads it, send/folder.py
  writes it); checkpoint steps and the last step are always written, whatever the transport.
- shard gather: the all-gather of several layers' FSDP shards, cast first, one collective per process group and dtype.
- loader: the callable a receiver hands each bucket's (name, tensor) pairs to (vLLM: `model.load_weights`).
- load recorder: the dispatch mode that watches the first version's loads and refuses at the first operation that is
  not a copy of received bytes into a parameter.
- copy plan: per loader call, the copies from views of the received tensors into views of the parameters, replayed as
  one fused copy per bucket; refused on vLLM's CPU build (it repacks linear weights), kept on bf16 GPU layers.
- probe: the trainer's log-probs of a fixed text under version N (probe.json), which the orchestrator compares with
  inference's after each load. Completeness is the engine's name accounting, correctness the probe; only delta
  updates carry a checksum (of each bucket's full new bytes).
- staging: a no-stall update's version received whole beside the model (which serves the version before) and loaded
  by the *swap* inside /finish_weight_update, between two engine steps; costs one copy of the published weights per
  worker (none more with delta: the mirror holds it).
- delta: a bucket sent as the elements whose bits changed since the version before (int32 indices + new values), when
  that is smaller than the bucket; the receiver's *mirror* holds the version before of every bucket (one copy of the
  published weights), and a bucket whose checksum fails goes again whole in the version's *repair round*.

Layers: `wire/` (what both sides agree on) imports nothing of `send/` or `receive/`; `receive/` (vLLM's workers)
imports `wire/` only, never `send/`, `slipstream.trainer`, `slipstream.parallel` or `slipstream.models`, so a vLLM
worker loads no trainer or FSDP code; `send/` (trainer ranks) may import the trainer and the models.
tests/unit/test_weights_layering.py enforces it. Process adapters stay with their processes: trainer/rl.py calls
send/publish.py, inference/vllm_plugin.py registers receive/engine.py, orchestrator/weights.py relays and verifies.
"""
