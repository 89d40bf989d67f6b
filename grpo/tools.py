"""Tools a policy may call in a multi-turn rollout (turns.py runs the loop), and the bounded pool that runs them.

A tool is a Python function named in the config as `rollout.tools=[path/to/file.py:function, ...]` (loaded like
`reward.reward_fn`). It is called as `fn(arguments, images)`: the call's JSON arguments (a dict) and the PIL images
of the conversation so far (the prompt's, then those earlier tool turns returned), and returns text, a PIL image, a
list of images, or a dict {"text": ..., "images": [...]}. Its `schema` attribute describes it to the model, as the
"function" entry of an OpenAI/Qwen tool list: {"name", "description", "parameters" (a JSON schema)}.

The model calls a tool Hermes-style, as Qwen's chat templates teach it:
`<tool_call>{"name": "crop", "arguments": {"box": [0, 0, 0.5, 0.5]}}</tool_call>`; the result comes back in a
`<tool_response>` turn. Tools run in worker processes with a time bound (grading.RewardScorer's pool), so a tool that
hangs or crashes costs its call an error message, never the step.

Shipped: `crop` (zoom into a box of one of the conversation's images) and `calculate` (a bounded arithmetic
evaluator: no eval, bounded in size and magnitude like the reward's guards).
"""

from __future__ import annotations

import ast
import json
import math
import operator
from dataclasses import dataclass, field

from grpo import grading

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# The kinds of failed call the model is told about and the metrics count (rollout/tool_<kind>).
FAULTS = ("malformed", "unknown", "error", "timeout")

# What the system prompt says where the chat template cannot present tools itself (rollout.tool_prompt's default);
# {tools} becomes one JSON schema a line.
TOOL_PROMPT = (
    "You can call tools. Their descriptions, one JSON object a line, are inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, write a JSON object with its name and arguments between <tool_call> and </tool_call>, e.g.\n"
    '<tool_call>\n{"name": "tool_name", "arguments": {"arg": "value"}}\n</tool_call>\n'
    "The result comes back in the next turn."
)


@dataclass
class ToolResult:
    text: str = ""
    images: list = field(default_factory=list)
    fault: str | None = None  # one of FAULTS when the call failed (text then says why)


def tool_name(spec: str) -> str:
    return spec.rpartition(":")[2]


def load_tool(spec: str):
    """The function named by "path/to/file.py:function", checked for a schema the model can be shown."""
    fn = grading.load_reward_fn(spec)
    schema = getattr(fn, "schema", None)
    if not isinstance(schema, dict) or schema.get("name") != tool_name(spec):
        raise ValueError(f"tool {spec!r}: the function needs a `schema` dict whose name is {tool_name(spec)!r}")
    return fn


def tools_problem(specs: list[str]) -> str | None:
    """Why the tools cannot be offered (a spec that does not load, a missing schema, two of one name), or None."""
    try:
        names = [load_tool(s).schema["name"] for s in specs]
    except ValueError as e:
        return str(e)
    return f"two tools are named {max(names, key=names.count)!r}" if len(set(names)) < len(names) else None


def schemas(specs: list[str]) -> list[dict]:
    """The tools' descriptions as chat templates take them (apply_chat_template(..., tools=...))."""
    return [{"type": "function", "function": load_tool(s).schema} for s in specs]


def tool_prompt(template: str, specs: list[str]) -> str:
    return template.replace("{tools}", "\n".join(json.dumps(s) for s in schemas(specs)))


def template_presents_tools(processor) -> bool:
    """Whether the checkpoint's chat template renders a `tools` argument (Qwen3-VL's does, Qwen2.5-VL's does not)."""
    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None) or ""
    return "tools" in str(template)


def parse_call(text: str, only: str | None = None) -> tuple[dict | None, str | None]:
    """The last `<tool_call>...</tool_call>` of a model turn as {"name", "arguments"}, or (None, why not). With
    `only` (the name of the one tool offered), an empty call -- nothing between the markers, or a `</tool_call>` with
    no `<tool_call>` before it in the turn -- calls that tool without arguments: a shorthand a small model can learn
    from scratch (the tool demo's random model could never write the JSON)."""
    start, end = text.rfind(TOOL_CALL), text.rfind(TOOL_CALL_END)
    if end == -1 or end < start:
        return None, "no <tool_call>...</tool_call> found"
    body = text[start + len(TOOL_CALL) : end].strip() if start != -1 else ""
    if only is not None and not body:
        return {"name": only, "arguments": {}}, None
    if start == -1:
        return None, "no <tool_call>...</tool_call> found"
    try:
        call = json.loads(body)
    except ValueError as e:
        return None, f"the tool call is not valid JSON: {e}"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None, 'a tool call must be a JSON object {"name": ..., "arguments": {...}}'
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        return None, "the tool call's arguments must be a JSON object"
    return {"name": call["name"], "arguments": arguments}, None


def as_result(value) -> ToolResult:
    """A tool's return value (text, an image, images, or {"text", "images"}) as a ToolResult."""
    from PIL import Image

    if isinstance(value, ToolResult):
        return value
    if isinstance(value, str):
        return ToolResult(text=value)
    if isinstance(value, Image.Image):
        return ToolResult(images=[value])
    if isinstance(value, (list, tuple)) and all(isinstance(v, Image.Image) for v in value):
        return ToolResult(images=list(value))
    if isinstance(value, dict) and set(value) <= {"text", "images"}:
        return ToolResult(text=str(value.get("text", "")), images=list(value.get("images", [])))
    raise TypeError(f"a tool must return text, images or {{'text', 'images'}}, got {type(value).__name__}")


# -----------------------------------------------------------------------------
# the pool: grading.RewardScorer's workers, each loading every tool, a call bounded like a grading


def _tool_worker_main(conn, specs: str) -> None:
    """Worker loop: load the tools once, then run (call, images) pairs one at a time. A tool's exception comes back
    as a result (fault "error"), so only a hang or a crash costs the worker."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the rank owns the workers' lifetime (see grading._worker_main)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        fns = {tool_name(s): load_tool(s) for s in specs.split("\n")}
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            call, images = conn.recv()
        except EOFError:
            return
        conn.send(("ok", run_call(fns, call, images)))


def run_call(fns: dict, call: dict, images: list) -> ToolResult:
    """One call, its failure turned into the message the model gets."""
    fn = fns.get(call["name"])
    if fn is None:
        return ToolResult(f"unknown tool {call['name']!r}; the tools are {', '.join(sorted(fns))}", fault="unknown")
    try:
        result = as_result(fn(call["arguments"], images))
    except Exception as e:
        return ToolResult(f"the tool {call['name']} failed: {type(e).__name__}: {e}", fault="error")
    return result


class ToolPool(grading.RewardScorer):
    """Runs a turn's tool calls, each bounded by `timeout` seconds, in persistent spawned workers that a hang gets
    killed and replaced (grading.RewardScorer's machinery). A call that times out or crashes its worker comes back
    as a ToolResult with fault "timeout"."""

    worker_main = staticmethod(_tool_worker_main)

    def __init__(self, specs: list[str], timeout: float = 10.0, num_workers: int = 1):
        paths = [grading.resolve_spec(s) for s in specs]
        specs = [f"{path}:{name}" for path, name in paths]  # absolute, so workers find them whatever their cwd
        self.fns = {tool_name(s): load_tool(s) for s in specs}  # fail fast, here, on a bad spec
        super().__init__(specs[0], timeout, num_workers)
        self.fn_spec = "\n".join(specs)  # what each worker loads

    def run(self, calls: list[dict], images: list[list]) -> list[ToolResult]:
        """One ToolResult per call ({"name", "arguments"}), called with the images of its conversation."""
        items = list(zip(calls, images, strict=True))
        if not items:
            return []
        if not self.timeout:
            return [run_call(self.fns, call, imgs) for call, imgs in items]
        results = self._score_in_workers(items)
        return [r if r is not None else ToolResult(f"the tool {c['name']} gave no answer within {self.timeout}s",
                                                   fault="timeout") for r, (c, _) in zip(results, items)]  # fmt: skip


# -----------------------------------------------------------------------------
# the shipped tools


def _box(arguments: dict, width: int, height: int) -> tuple[int, int, int, int]:
    """[x1, y1, x2, y2] in pixels, or relative to the image's sides when every value lies in [0, 1]."""
    box = arguments.get("box")
    if not isinstance(box, (list, tuple)) or len(box) != 4 or not all(isinstance(v, (int, float)) for v in box):
        raise ValueError("box must be [x1, y1, x2, y2]")
    if all(0 <= v <= 1 for v in box):
        box = [box[0] * width, box[1] * height, box[2] * width, box[3] * height]
    x1, y1, x2, y2 = (round(v) for v in box)
    x1, x2 = max(0, min(x1, x2)), min(width, max(x1, x2))
    y1, y2 = max(0, min(y1, y2)), min(height, max(y1, y2))
    if x2 - x1 < 1 or y2 - y1 < 1:
        raise ValueError(f"the box {list(box)} holds no pixel of the {width}x{height} image")
    return x1, y1, x2, y2


def crop(arguments: dict, images: list):
    """The box of one of the conversation's images, scaled up to the source image's pixel count (aspect kept), so
    the zoomed region gets as many image tokens as the whole picture had: within the data's image budget, which the
    source image was fitted to."""
    from PIL import Image

    index = arguments.get("image", 0)
    if not isinstance(index, int) or not -len(images) <= index < len(images):
        raise ValueError(f"image must be an index into the conversation's {len(images)} images")
    source = images[index]
    x1, y1, x2, y2 = _box(arguments, *source.size)
    region = source.crop((x1, y1, x2, y2))
    scale = math.sqrt(source.width * source.height / (region.width * region.height))
    size = (max(1, round(region.width * scale)), max(1, round(region.height * scale)))
    return region.resize(size, Image.Resampling.BICUBIC)


crop.schema = {
    "name": "crop",
    "description": "Zoom into a region of an image: returns the box of the image, enlarged.",
    "parameters": {
        "type": "object",
        "properties": {
            "box": {"type": "array", "items": {"type": "number"}, "description": "[x1, y1, x2, y2], in pixels or "
                    "as fractions of the width and height (all values in [0, 1])"},
            "image": {"type": "integer", "description": "which image of the conversation, 0 = the first"},
        },
        "required": ["box"],
    },
}  # fmt: skip


MAX_EXPRESSION_CHARS = 500
MAX_MAGNITUDE = 1e100  # no geometry computation needs more; bounds every intermediate value
MAX_EXPONENT = 1000  # no geometry computation needs a larger power (the bound of the reward guard, reward.py)
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.Pow: operator.pow, ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv}  # fmt: skip
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
FUNCTIONS = {
    "sqrt": math.sqrt, "sin": lambda d: math.sin(math.radians(d)), "cos": lambda d: math.cos(math.radians(d)),
    "tan": lambda d: math.tan(math.radians(d)), "asin": lambda x: math.degrees(math.asin(x)),
    "acos": lambda x: math.degrees(math.acos(x)), "atan": lambda x: math.degrees(math.atan(x)), "abs": abs,
    "log": math.log, "exp": math.exp, "round": round,
}  # fmt: skip
CONSTANTS = {"pi": math.pi, "e": math.e}


def evaluate(node):
    """The value of an arithmetic syntax tree: numbers, + - * / // % **, the FUNCTIONS (angles in degrees) and
    CONSTANTS; anything else raises. Exponents and every value stay bounded, so no input runs long."""
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        value = node.value
    elif isinstance(node, ast.Name) and node.id in CONSTANTS:
        value = CONSTANTS[node.id]
    elif isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        value = UNARY[type(node.op)](evaluate(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = evaluate(node.left), evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large")
        value = BINARY[type(node.op)](left, right)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
          and len(node.args) == 1 and not node.keywords):  # fmt: skip
        value = FUNCTIONS[node.func.id](evaluate(node.args[0]))
    else:
        raise ValueError(f"unsupported expression: {ast.dump(node)[:80]}")
    if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
        raise ValueError("the value is out of range")
    return value


def calculate(arguments: dict, images: list) -> str:
    """Evaluate an arithmetic expression, e.g. "2 * sqrt(3) * sin(30)"; angles in degrees."""
    expression = arguments.get("expression")
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    value = evaluate(ast.parse(expression.replace("^", "**"), mode="eval"))
    return f"{value:.10g}" if isinstance(value, float) else str(value)


calculate.schema = {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression: + - * / ** %, sqrt, sin/cos/tan (degrees), asin/acos/atan, "
    "log, exp, pi.",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 2 * sqrt(3) * sin(30)"}},
        "required": ["expression"],
    },
}
