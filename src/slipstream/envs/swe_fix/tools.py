"""Coding-agent tools executed in the rollout's sandbox: `bash`, `write_file` and `edit_file`.

File tools run a small Python helper inside the sandbox (never on the host), so paths, symlinks and permissions are
resolved in the sandbox's view of the repository; paths must stay inside the repository.
"""

import json

from slipstream.envs.base import State
from slipstream.envs.tools import Tool, ToolError
from slipstream.sandbox import Sandbox, SandboxResult

_FILE_HELPER = r"""
import json, os, sys
request = json.load(sys.stdin)
root = os.path.realpath(os.getcwd())
relative = request["path"]
path = os.path.realpath(os.path.join(root, relative))
if os.path.commonpath([root, path]) != root:
    sys.exit(f"{relative} is outside the repository")
if request["op"] == "write":
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(request["content"])
    print(f"wrote {len(request['content'])} characters to {relative}")
    sys.exit(0)
try:
    with open(path) as f:
        text = f.read()
except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError) as e:
    sys.exit(f"cannot read {relative}: {type(e).__name__}")
count = text.count(request["old"]) if request["old"] else 0
if count != 1:
    hint = " (include more surrounding lines so it is unique)" if count > 1 else ""
    sys.exit(f"old_text occurs {count} times in {relative}; it must occur exactly once{hint}")
with open(path, "w") as f:
    f.write(text.replace(request["old"], request["new"], 1))
print(f"edited {relative}")
"""


def format_result(result: SandboxResult) -> str:
    """A command's outcome as the model sees it."""
    parts = [f"exit code: {result.returncode}"]
    if result.killed_reason is not None:
        parts.append(f"killed: {result.killed_reason.replace('_', ' ')} limit reached")
    if result.stdout:
        parts.append(f"stdout:\n{result.stdout}")
    if result.stderr:
        parts.append(f"stderr:\n{result.stderr}")
    if result.truncated:
        parts.append("[output truncated]")
    return "\n".join(parts)


async def run_file_helper(sandbox: Sandbox, request: dict[str, str]) -> str:
    """Run one file operation inside the sandbox; failures raise ToolError with the helper's message."""
    result = await sandbox.arun(["python3", "-s", "-E", "-c", _FILE_HELPER], stdin=json.dumps(request))
    if not result.ok:
        message = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else format_result(result)
        raise ToolError(message)
    return result.stdout.strip()


async def bash(state: State, command: str) -> str:
    return format_result(await state["sandbox"].arun(command))


async def write_file(state: State, path: str, content: str) -> str:
    return await run_file_helper(state["sandbox"], {"op": "write", "path": path, "content": content})


async def edit_file(state: State, path: str, old_text: str, new_text: str) -> str:
    request = {"op": "edit", "path": path, "old": old_text, "new": new_text}
    return await run_file_helper(state["sandbox"], request)


def _string_params(**descriptions: str) -> dict:
    return {
        "type": "object",
        "properties": {name: {"type": "string", "description": text} for name, text in descriptions.items()},
        "required": list(descriptions),
    }


CODING_TOOLS = (
    Tool(
        "bash",
        "Run a bash command in the repository root (no network; output is truncated when long).",
        _string_params(command="The command, e.g. 'python3 -m unittest -v' or 'cat src/module.py'."),
        bash,
    ),
    Tool(
        "write_file",
        "Create or overwrite a file of the repository with the given content.",
        _string_params(path="Path relative to the repository root.", content="The whole new file content."),
        write_file,
    ),
    Tool(
        "edit_file",
        "Replace one exact, unique occurrence of old_text with new_text in a file of the repository.",
        _string_params(
            path="Path relative to the repository root.",
            old_text="Text to replace; must occur exactly once, whitespace included.",
            new_text="Replacement text.",
        ),
        edit_file,
    ),
)
