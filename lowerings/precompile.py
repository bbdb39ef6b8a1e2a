"""Compile the Triton kernels of memopt's opaque ops in the background while Inductor compiles the graph.

Inductor compiles the kernels it emits in its pool of workers, before the first step runs. memopt's opaque ops
launch theirs eagerly (the CCE backward behind ``cce`` and ``cce_with_logits``, the row-wise CCE, WTA-CRS's
draw, opaque sample and estimate update), so Triton's JIT compiled each one at its first launch, inside the first
training step, one after the other on the main thread: about 2.4 s of a cold first call on the H200
(`benchmarks/first_call.py`, cold). Once a graph is rewritten, the backend hands it to ``start``: a worker thread
runs each opaque call's launch code on meta tensors of the call's shapes with its launches turned into Triton's
``warmup`` (``_library.warming``), which compiles exactly the specialization the real launch asks for (argument
dtypes, integer values, pointer alignment, constexprs) into the kernel's cache. Triton releases the GIL in its
compiler passes and in ptxas, so Inductor's own compile goes on meanwhile. Two threads warm distinct calls; the
warm-ups of one kernel take turns (``_library.compile_lock``), so each specialization compiles once.

A warm-up that fails, or that compiles a specialization the launch then does not ask for, costs nothing but the
compile at the launch, as before: errors are logged, never raised. The backend's ``precompile`` option (or
``MEMOPT_PRECOMPILE=0``) turns it off.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable

import torch
import torch.fx as fx

from lowerings._library import HAS_TRITON, NAMESPACE, interpreting, warming

log = logging.getLogger(__name__)

Warmer = Callable[..., None]
_WARMERS: dict[object, Warmer] = {}  # by op name ("cce") or, for a Python function in the graph, the function
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
# One task a distinct call: two threads overlap, say, the CCE backward's kernels with WTA-CRS's.
_THREADS = 2
THREAD_NAME = "memopt-precompile"


def warmer(target: str | Callable) -> Callable[[Warmer], Warmer]:
    """Register how to warm the kernels that a call of ``memopt::<target>`` (or of the Python function
    ``target``, which a rule may insert and AOTAutograd traces) launches eagerly on CUDA, its backward's
    included: a function of the call's arguments, tensors passed as meta tensors of their layout, that runs the
    op's launch code. Launches inside it only compile."""

    def register(function: Warmer) -> Warmer:
        _WARMERS[target] = function
        return function

    return register


class UnknownSize(Exception):
    """A size without a value (and no hint) at compile time: the launch's specialization is not known yet."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a launch's specialization sees of a tensor argument, as a hashable value."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    aligned: bool  # 16-byte aligned data pointer, its storage assumed aligned
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        offset_bytes = _int(tensor.storage_offset()) * tensor.element_size()
        return cls(
            tuple(_int(size) for size in tensor.shape), tuple(_int(step) for step in tensor.stride()), tensor.dtype,
            tensor.device, offset_bytes % 16 == 0, tensor.requires_grad,
        )

    def meta(self) -> torch.Tensor:
        """A meta tensor of this layout, one element off an aligned address where the original was misaligned."""
        offset = 0 if self.aligned else 1
        extent = 1 + sum((size - 1) * step for size, step in zip(self.shape, self.stride, strict=True))
        extent = extent if all(self.shape) else 0
        flat = torch.empty(offset + extent, dtype=self.dtype, device="meta")
        tensor = flat.as_strided(self.shape, self.stride, offset)
        return tensor.requires_grad_() if self.requires_grad and self.dtype.is_floating_point else tensor


def _int(value) -> int:
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is None:
            raise UnknownSize(str(value))
        return int(hint)
    return int(value)


def _spec(value):
    """An argument of a graph call as ``TensorSpec``, int or constant; lists element by element."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val", value.meta.get("example_value"))
        if value is None:
            raise UnknownSize("an argument without a value")
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, list | tuple):
        return tuple(_spec(item) for item in value)
    if isinstance(value, torch.SymInt):
        return _int(value)
    return value


def _materialize(value):
    if isinstance(value, TensorSpec):
        return value.meta()
    if isinstance(value, tuple):
        return [_materialize(item) for item in value]
    return value


def _warmer_key(target) -> object:
    """``"cce"`` for ``torch.ops.memopt.cce.default``; any other target as it is."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == NAMESPACE:
        return target._schema.name.split("::", 1)[1]
    return target


Call = tuple[object, tuple, tuple]  # warmer key, positional arguments, (keyword, argument) pairs; tensors as specs


def calls(graph: fx.Graph, device_type: str = "cuda") -> list[Call]:
    """(warmer key, arguments, keyword arguments; tensors as specs) of the calls in ``graph`` that have a warmer
    and run on ``device_type``, each distinct call once (a model's identical blocks share one); calls with a size
    unknown at compile time are left to compile at their launch."""
    found: dict[Call, None] = {}
    for node in graph.nodes:
        name = _warmer_key(node.target) if node.op == "call_function" else None
        if name is None or name not in _WARMERS:
            continue
        try:
            args = tuple(_spec(arg) for arg in node.args)
            kwargs = tuple((key, _spec(value)) for key, value in node.kwargs.items())
        except UnknownSize as unknown:
            log.debug("memopt precompile: %s left to its launch (%s)", node, unknown)
            continue
        if any(isinstance(arg, TensorSpec) and arg.device.type == device_type for arg in _flat(args)):
            found[(name, args, kwargs)] = None
    return list(found)


def _flat(values: Iterable) -> Iterable:
    for value in values:
        if isinstance(value, tuple):
            yield from _flat(value)
        else:
            yield value


def enabled() -> bool:
    return HAS_TRITON and not interpreting() and torch.cuda.is_available()


def start(gm: fx.GraphModule) -> list[concurrent.futures.Future] | None:
    """Compile, in worker threads, the kernels that the opaque calls of ``gm`` (its checkpointed regions' bodies
    included) will launch: one task a distinct call, each resolving to 1 if it was warmed. None (nothing
    started) where there is nothing to do."""
    if not enabled():
        return None
    try:
        todo = list(dict.fromkeys(
            call for module in gm.modules() if isinstance(module, fx.GraphModule) for call in calls(module.graph)
        ))
    except Exception:  # an argument this module does not know how to describe: the launches compile as before
        log.debug("memopt precompile: listing the calls failed", exc_info=True)
        return None
    if not todo:
        return None
    device = next(arg.device for _, args, _ in todo for arg in _flat(args) if isinstance(arg, TensorSpec))
    index = device.index if device.index is not None else torch.cuda.current_device()
    prepare_triton()
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(_THREADS, thread_name_prefix=THREAD_NAME)
    futures = [_POOL.submit(warm, [call], index) for call in interleaved(todo)]
    _PENDING.extend(futures)
    return futures


_PENDING: list[concurrent.futures.Future] = []


def prepare_triton() -> None:
    """Compute here, once, what each thread's first Triton compile would otherwise compute side by side: Triton's
    cache key of its own install (``triton_key``: a Python loop hashing libtriton's hundreds of megabytes in 1 MB
    reads) and its CUDA driver. In the warm-up threads, beside a main thread busy loading Inductor's cached
    graph, each waited for the GIL at every read: ~2.1 s a thread on a warm start on the H200, and the first
    step 1.20x torch.compile's against 0.97x with no warm-up (`benchmarks/first_call.py`, warm). Here it takes
    a fraction of a second that the process's first memopt launch would spend anyway."""
    try:
        from triton.runtime import driver
        from triton.runtime.cache import triton_key

        triton_key()  # functools.lru_cache'd: every later compile of this process reads it
        driver.active.get_current_device()
    except Exception:  # an older or newer Triton: the threads compute them, as before
        log.debug("memopt precompile: preparing Triton failed", exc_info=True)


def interleaved(todo: list[Call]) -> list[Call]:
    """``todo`` in rounds of one call per warmer, in order of first appearance. Calls of one warmer mostly compile
    one kernel (GPT-2's sample calls differ in width, not in their draw), which ``_library.compile_lock`` lets
    only one thread compile; queued side by side, the second thread would wait on the first instead of
    compiling another warmer's kernels."""
    by_warmer: dict[object, list[Call]] = {}
    for call in todo:
        by_warmer.setdefault(call[0], []).append(call)
    rounds = itertools.zip_longest(*by_warmer.values())
    return [call for round_ in rounds for call in round_ if call is not None]


def wait(timeout: float | None = None) -> int:
    """Block until every warm-up started and not yet waited for is done; the number of calls they warmed. For
    tests and benchmarks: training never waits (a launch whose kernel is not ready yet compiles it, as without
    this)."""
    done, _ = concurrent.futures.wait(list(_PENDING), timeout=timeout)
    for future in done:
        _PENDING.remove(future)
    return sum(future.result() for future in done)


def warm(todo: list[Call], device_index: int | None = None) -> int:
    """Run each call's warmer on meta tensors, launches compiling only, for CUDA device ``device_index``
    (None: the current device, as the stand-in driver of the sm_90 compile checks has it). Returns the number
    of calls warmed without an error."""
    warmed = 0
    with _on_device(device_index), warming(), torch.no_grad():
        for name, args, kwargs in todo:
            try:
                _WARMERS[name](*map(_materialize, args), **{key: _materialize(value) for key, value in kwargs})
                warmed += 1
            except Exception:  # the launch compiles it then, as without precompiling
                log.debug("memopt precompile: warming %s failed", name, exc_info=True)
    return warmed


def _on_device(index: int | None):
    return torch.cuda.device(index) if index is not None else contextlib.nullcontext()
