"""Grading: any reward function, named by a "path/to/file.py:function" spec, loaded, called under its contract and
run with a hard time bound. The rewards themselves, and the contract a reward function keeps, are in reward.py.

- resolve_spec, load_reward_fn: find and load the function a spec names (the shipped tools are loaded the same way).
- call_reward: the contract's check (a number, or a dict with "overall", every value finite); keyword_columns and
  reward_kwargs: the row's columns a function asks for by keyword; peer_contract: how to wrap a reward written for
  verl, EasyR1 or TRL, said when one fails; equal_reward_groups: the prompt groups a reward does not tell apart.
- RewardScorer: grades batches in persistent worker processes and kills any that hang, and stops the run when every
  answer of a step failed to grade; default_num_workers: how many per rank. (tools.ToolPool runs tool calls on the
  same machinery.)
"""

import atexit
import contextlib
import importlib
import importlib.util
import inspect
import logging
import math
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import wait
from numbers import Real
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent  # the checkout: grpo/ sits at its top
DEFAULT_SPEC = "reward.py:compute_score"
BASE_KEYS = ("overall", "format", "accuracy")
# the trainer's own reward/<name> metrics: a reward's key of one of these names is not logged again as its own
RESERVED_KEYS = (*BASE_KEYS, "shaped", "errors", "timeouts", "timeouts_step", "zero_std_groups")

# -----------------------------------------------------------------------------
# user reward functions


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def resolve_spec(spec: str) -> tuple[Path, str]:
    """Split "path/to/file.py:function" into an absolute path and a function name.

    A relative path is looked up under the cwd first, then under the repo, so the default
    "reward.py:compute_score" works from any directory. A bare file name that neither has is looked up last among
    the package's modules (grpo/), so that the shipped tools keep their specs "tools.py:crop" and "tools.py:calculate".
    """
    path_str, sep, name = spec.rpartition(":")
    if not sep or not path_str.endswith(".py") or not name:
        raise ValueError(f"reward spec {spec!r} must look like 'path/to/file.py:function'")
    path = Path(path_str).expanduser()
    places = f"cwd and {REPO_DIR}"
    if not path.is_absolute() and not path.exists():
        bare = path.name == path_str  # no folder named
        path = REPO_DIR / path
        if bare and not path.exists():
            path, places = PACKAGE_DIR / path.name, f"cwd, {REPO_DIR} and {PACKAGE_DIR}"
    if not path.is_file():
        raise ValueError(f"reward spec {spec!r}: file {path_str} not found (looked in {places})")
    return path.resolve(), name


def load_reward_fn(spec: str) -> Callable[[str, str], dict]:
    """Load the function named by a "path/to/file.py:function" spec; ValueError if it can't be found. A module of the
    package (the shipped tools) is imported as what it is, grpo.<name>, not loaded a second time under another name."""
    path, name = resolve_spec(spec)
    module = importlib.import_module(f"grpo.{path.stem}") if path.parent == PACKAGE_DIR else _load_file(spec, path)
    fn = getattr(module, name, None)
    if not callable(fn):
        own = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise ValueError(f"reward spec {spec!r}: {path} has no function {name!r} (its functions: {', '.join(own)})")
    return fn


def _load_file(spec: str, path: Path):
    module_name = f"reward_fn_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses look up their defining module here
    # Its folder on the import path, as running the file would put it, so that its helper modules import: first
    # while it loads; then last, for imports inside its calls, where it shadows no module of the trainer's
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"reward spec {spec!r}: importing {path} failed: {_describe(e)}") from e
    finally:
        sys.path.remove(folder)
        if folder not in sys.path:
            sys.path.append(folder)
    return module


def call_reward(fn: Callable, response: str, ground_truth: str, **columns) -> dict[str, float]:
    """Call a reward function and check its result, so a bad return value is an error here, not in the trainer.

    A number is the overall reward; a dict needs an "overall" key, and every value must be a number. `columns` are
    the keyword arguments the function asked for (keyword_columns)."""
    result = _number(fn(response, ground_truth, **columns))
    if isinstance(result, Real):
        result = {"overall": result}
    if isinstance(result, dict):
        result = {key: _number(value) for key, value in result.items()}
    if not isinstance(result, dict) or "overall" not in result:
        verl = isinstance(result, dict) and "score" in result  # (verl's reward managers read a dict's 'score')
        raise TypeError(
            f"the reward function returned {type(result).__name__} {result!r:.100}; it must return a number or a dict "
            f"with an 'overall' key{' (rename its score to overall)' if verl else ''}"
        )
    wrong = [key for key, value in result.items() if not isinstance(value, Real) or not math.isfinite(value)]
    if wrong:  # (a NaN would reach the advantage of its whole group)
        raise TypeError(f"the reward function's {wrong[0]!r} is {result[wrong[0]]!r:.100}, not a finite number")
    return {str(key): float(value) for key, value in result.items()}


def _number(value):
    """A one-value array or tensor as its number (numpy's bool, a 0-d array, a 0-d torch tensor, as comparisons and
    reductions return them: .item()); anything else as it is."""
    item = getattr(value, "item", None)
    if not isinstance(value, Real) and callable(item) and tuple(getattr(value, "shape", (None,))) == ():
        return item()
    return value


def peer_contract(fn: Callable) -> str | None:
    """How to call fn from this trainer when its signature is another trainer's reward contract, or None. The rewards
    users bring come from verl, EasyR1 and TRL, and each fails here on its first call with an error of its own that
    does not say why (a missing argument, a string indexed as a dict, a list returned, another trainer's config key).
    Read from the parameter names alone: the run names it only in its stop when every answer fails; the dry run
    refuses such a function outright (its first parameter would get the answer's text, and with defaults or a column
    of a matching name a call may even return a score, graded on the wrong arguments)."""
    try:
        names = [p.name for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):
        return None
    f = getattr(fn, "__name__", "fn")
    wrap = "this trainer calls fn(response, ground_truth) once per answer: wrap it, def score(response, ground_truth"
    if names[:2] == ["data_source", "solution_str"]:
        return (
            f"its parameters are verl's (data_source, solution_str, ground_truth, extra_info); {wrap}): return "
            f"{f}('<data_source>', response, ground_truth) (a verl dict keeps the reward under 'score')"
        )
    if names[:1] == ["reward_inputs"]:
        return (
            f"it is EasyR1's batch form (a list of dicts with 'response' and 'ground_truth', a list of scores "
            f"back); {wrap}): return {f}([{{'response': response, 'ground_truth': ground_truth}}])[0]"
        )
    if names[:1] == ["reward_input"]:
        return (
            f"it is EasyR1's sequential form (one dict with 'response' and 'ground_truth'); {wrap}): return "
            f"{f}({{'response': response, 'ground_truth': ground_truth}})"
        )
    if "completions" in names[:2]:  # TRL passes every argument by keyword, prompts too
        prompt = ("prompt", "prompts=[prompt], ") if "prompts" in names else ("", "")
        return (
            f"it is TRL's form (lists of completions and of the data's columns, a list of floats back); "
            f"{wrap}{', ' * bool(prompt[0])}{prompt[0]}): return {f}({prompt[1]}completions=[response], "
            f"solution=[ground_truth])[0] (its own answer column for solution; chat completions as "
            f"[[{{'role': 'assistant', 'content': response}}]])"
        )
    return None


def equal_reward_groups(overall: list[float], n: int) -> int:
    """How many of the consecutive groups of n rewards (a prompt's answers) are all equal: the reward tells their
    answers apart in no way, and unless an overlong penalty or the KL in the reward does, their advantages are zero
    and they teach the policy nothing (the trainer logs their share as reward/zero_std_groups)."""
    return sum(len(set(overall[i : i + n])) == 1 for i in range(0, len(overall), n))


def keyword_columns(fn: Callable) -> bool | frozenset[str]:
    """What a reward function gets beyond (response, ground_truth), decided from its signature as TRL does for
    dataset columns: True for a `**kwargs` (every column of the row, question and prompt), else the names of its
    further parameters that can be passed by keyword (each a column of the row, `question` or `prompt`)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: called with the two arguments
        return frozenset()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return True
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return frozenset(p.name for p in named[2:])


def reward_kwargs(example, wanted: bool | frozenset[str]) -> dict:
    """The keyword arguments a reward function asked for, from a data.Example: its row's columns as the file has
    them, `question` (the problem text, before the format prompt) and `prompt` (the chat text the model read)."""
    if not wanted:
        return {}
    values = {**getattr(example, "columns", {}), "question": example.problem, "prompt": example.prompt}
    return values if wanted is True else {k: v for k, v in values.items() if k in wanted}


def _answer(response: str) -> str:
    return f"{response[:120]!r}{'...' if len(response) > 120 else ''}"


# -----------------------------------------------------------------------------
# time-bounded scoring in worker processes

STARTUP_TIMEOUT = 120.0  # seconds for a fresh worker to import its reward function
# Each worker holds its own sympy and parsers (~70 MB resident); a rank's share of a step (2,560 answers over 8 GPUs,
# ~7 ms of CPU each) grades in well under a second on 8 of them, so more would only add start-up time and memory.
MAX_DEFAULT_WORKERS = 8


def default_num_workers(local_ranks: int = 1) -> int:
    """Grading processes for one rank: the cores this process may run on, shared among the ranks on this node.

    local_ranks is the number of ranks on this node (torchrun's LOCAL_WORLD_SIZE). At least 1, at most
    MAX_DEFAULT_WORKERS. Assumes the node's ranks share one CPU set, as under torchrun; where a launcher pins each
    rank to its own cores (srun with one task per GPU), the affinity already is the rank's share: pass 1.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_WORKERS, cores // max(1, local_ranks)))


def _worker_main(conn, fn_spec: str) -> None:
    """Worker loop: load the reward function once, then grade (response, ground_truth) pairs one at a time."""
    # math_verify warns that its own timeout is off; here the parent is the timeout
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # torchrun and Slurm signal the rank's whole process group on preemption; the rank finishes its step (and needs
    # its graders for that) before it exits, and it owns the workers' lifetime anyway
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        fn = load_reward_fn(fn_spec)
    except Exception as e:
        conn.send(("failed", _describe(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            response, ground_truth, columns = conn.recv()
        except EOFError:  # the parent closed the pipe or died: nothing left to do
            return
        try:
            conn.send(("ok", call_reward(fn, response, ground_truth, **columns)))
        except Exception as e:
            conn.send(("error", _describe(e)))


@contextlib.contextmanager
def _main_script_left_out():
    """spawn runs the parent's main script again in each child (as __mp_main__), so that what the child unpickles by
    reference from it resolves. A worker's target and arguments live in this module and the standard library, and
    the trainer's script would cost each worker start the import of torch and FSDP (seconds of CPU, for every rank
    and every restart after a timeout) for nothing: the child is told of no main script (multiprocessing.spawn's
    get_preparation_data reads __main__'s __spec__ and __file__ while start() runs)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {key: main.__dict__[key] for key in ("__spec__", "__file__") if key in main.__dict__}
    main.__spec__, main.__file__ = None, None
    try:
        yield
    finally:
        for key in ("__spec__", "__file__"):
            main.__dict__.pop(key, None)
        main.__dict__.update(saved)


class _Worker:
    """One grading process, the pipe to it, and the item it is grading (index, deadline)."""

    def __init__(self, ctx, fn_spec: str, main=_worker_main):
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=main, args=(child_conn, fn_spec), daemon=True)
        with _main_script_left_out():
            self.proc.start()
        child_conn.close()  # keep only the child's copy, so its exit shows up here as EOF
        self.ready = False
        self.index = None
        self.deadline = time.monotonic() + STARTUP_TIMEOUT

    @property
    def idle(self) -> bool:
        return self.ready and self.index is None

    def submit(self, index: int, item: tuple, timeout: float) -> None:
        self.conn.send(item)
        self.index = index
        self.deadline = time.monotonic() + timeout

    def kill(self) -> None:
        # workers keep no state worth saving, so there is no graceful shutdown to wait for
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class RewardScorer:
    """Scores batches with a reward function, each call bounded by `timeout` seconds.

    sympy can hang or eat memory on hostile answers like \\boxed{9^{9^{9}}}, and a signal alarm cannot
    interrupt one long big-int operation, so the only reliable bound is a process we can kill. Workers are
    persistent (one pipe round trip per item, not a process per item) and started with 'spawn', because the
    trainer holds CUDA and torch.distributed threads that a fork would copy in a broken state. A timed-out
    worker is killed and replaced; its item scores zeros and counts in n_timeouts. An exception in the
    reward function, a return value call_reward rejects, or a worker crash scores zeros and counts in n_errors;
    last_error says what happened, and call_errors lists the failures of the last score() call (each with the answer
    it failed on), which report_failures turns into a message or a stop.
    Both counters are cumulative over the scorer's life (a checkpoint saves them): a step's own count, over
    however many score() calls the step makes, is the difference of n_timeouts before and after it.
    The keyword arguments the function asks for (keyword_columns) come from the examples passed to score().

    The reward function is named by spec and loaded inside each worker, so it never has to be picklable.
    With timeout None or 0 the function is called directly in this process: cheap, but unbounded.
    Like any spawn user, the trainer's main script needs an `if __name__ == "__main__":` guard.
    (tools.ToolPool runs tool calls in the same machinery, with its own `worker_main`.)
    """

    worker_main = staticmethod(_worker_main)  # the loop a worker process runs

    def __init__(self, fn_spec: str = DEFAULT_SPEC, timeout: float | None = 5.0, num_workers: int = 1):
        path, name = resolve_spec(fn_spec)
        self.fn_spec = f"{path}:{name}"  # absolute, so workers find it whatever their cwd
        self.fn = load_reward_fn(self.fn_spec)  # fail fast, here, on a bad spec
        self.columns = keyword_columns(self.fn)  # what the data keeps of each row for it (data.PromptDataset)
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be at least 1 (default_num_workers() picks one)")
        self.timeout = timeout
        self.num_workers = num_workers
        self.n_timeouts = 0
        self.n_errors = 0
        self.last_error: str | None = None
        self.call_errors: list[str] = []  # the last score() call's failures
        self.call_size = 0  # and its answers
        self.shown_step = -1  # the step whose first failure report_failures printed
        self.keys = list(BASE_KEYS)  # grows with extra keys the reward function returns
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        atexit.register(self.close)

    def score(self, responses: list[str], ground_truths: list[str], examples: list | None = None):
        """One score dict per response; timed-out or failed items get 0.0 for every key. `examples` (data.Example,
        one per response) give the keyword arguments the function asks for."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        columns = [reward_kwargs(ex, self.columns) for ex in examples] if examples else [{}] * len(responses)
        items = list(zip(responses, ground_truths, columns, strict=True))
        self.call_errors, self.call_size = [], len(items)
        if not items:
            return []
        if self.timeout:
            results = self._score_in_workers(items)
        else:
            results = [self._score_here(item) for item in items]
        return self._fill_failures(results)

    def _score_here(self, item: tuple) -> dict[str, float] | None:
        try:
            return call_reward(self.fn, *item[:2], **item[2])
        except Exception as e:
            self._record_error(_describe(e), item)
            return None

    def all_failed(self) -> bool:
        """Whether every answer of the last score() call failed to grade (timeouts aside: a slow grader is no bug)."""
        return self.call_size > 0 and len(self.call_errors) == self.call_size

    def report_failures(self, step: int, everywhere: bool, first_rank: int | None, rank: int) -> None:
        """After a score() call whose failures the ranks have compared (collective, in the caller): stop the run
        when every answer of every rank failed, with the function's own error; else the first rank with a failure
        prints its first error, once a step."""
        if everywhere:
            peer = peer_contract(self.fn)
            raise SystemExit(
                f"error: step {step}: the reward function failed on every answer, e.g. {self.call_errors[0]}; "
                f"{peer + '; ' if peer else ''}fix reward.reward_fn={self.fn_spec} (python train_grpo.py CONFIG "
                "--dry-run calls it on a sample)"
            )
        if first_rank is not None and self.shown_step != step:
            self.shown_step = step
            if first_rank == rank:
                failed = f"{len(self.call_errors)} of {self.call_size} answers on rank {rank}"
                print(f"reward: step {step}: {failed} failed to grade (scored 0, counted in reward/errors); the first: "
                      f"{self.call_errors[0]}", flush=True)  # fmt: skip

    def _score_in_workers(self, items: list[tuple]) -> list[dict[str, float] | None]:
        results = [None] * len(items)
        todo = deque(range(len(items)))
        try:
            while len(self._workers) < self.num_workers:
                self._workers.append(_Worker(self._ctx, self.fn_spec, self.worker_main))
            while todo or any(w.index is not None for w in self._workers):
                for w in self._workers:
                    if w.idle and todo:
                        i = todo.popleft()
                        w.submit(i, items[i], self.timeout)
                self._collect(results, items)
        except BaseException:
            # an interrupted batch leaves answers in flight that would be read as the next batch's: start clean
            self.close()
            raise
        return results

    def _collect(self, results: list, items: list[tuple]) -> None:
        """Wait for the next worker message or deadline; store results, replace hung or dead workers."""
        waiting = [w for w in self._workers if not w.idle]
        next_deadline = min(w.deadline for w in waiting)
        wait([w.conn for w in waiting], timeout=max(0.0, next_deadline - time.monotonic()))
        for k, w in enumerate(self._workers):
            if w.idle:
                continue
            if w.conn.poll():
                try:
                    status, payload = w.conn.recv()
                except (EOFError, OSError):
                    status, payload = "crashed", f"reward worker died (exit code {w.proc.exitcode})"
            elif time.monotonic() >= w.deadline:
                limit = self.timeout if w.ready else STARTUP_TIMEOUT
                status, payload = "timeout", f"no answer from the reward worker within {limit}s"
            else:
                continue
            if not w.ready:
                if status != "ready":
                    raise RuntimeError(f"reward worker for {self.fn_spec} failed to start: {payload}")
                w.ready = True
            elif status == "ok":
                results[w.index] = payload
                w.index = None
            elif status == "error":
                self._record_error(payload, items[w.index])
                w.index = None
            else:  # timeout or crash: the worker is unusable, replace it; its item stays a failure
                if status == "timeout":
                    self.n_timeouts += 1
                    self.last_error = payload
                else:
                    self._record_error(payload, items[w.index])
                w.kill()
                self._workers[k] = _Worker(self._ctx, self.fn_spec, self.worker_main)

    def _record_error(self, message: str, item: tuple) -> None:
        if isinstance(item[0], str):  # a reward's answer (a ToolPool's items are tool calls)
            message = f"{message} (on the answer {_answer(item[0])})"
        self.n_errors += 1
        self.last_error = message
        self.call_errors.append(message)

    def _fill_failures(self, results: list[dict[str, float] | None]) -> list[dict[str, float]]:
        # failures get the same keys as successes, so the trainer can average every key over the batch
        for result in results:
            if result is not None:
                self.keys += [key for key in result if key not in self.keys]
        return [result if result is not None else dict.fromkeys(self.keys, 0.0) for result in results]

    def close(self) -> None:
        """Kill the workers. Safe to call twice; score() after close() starts fresh ones."""
        for w in self._workers:
            w.kill()
        self._workers = []

    def extra_keys(self) -> list[str]:
        """The keys the function returned beyond the trainer's own, logged as reward/<key>."""
        return [key for key in self.keys if key not in RESERVED_KEYS]

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
