"""The failing step replayed op by op, to the first aten op that made inf or NaN.

A non-finite loss or gradient says that a step broke, not where. `trace_step` runs the step's
forward (and backward) once more under a `TorchDispatchMode` that sees every aten op, with a
`ModuleTracker` saying which module it ran in and whether in the backward; the first op whose
output is non-finite while its floating inputs are finite is where precision broke.

The cost is the replay's only: nothing here runs on a healthy step, except the RNG snapshot the
caller keeps before each step (`rng_snapshot()`: a copy of the CPU generator's few KB, and of each
CUDA generator's seed and offset) so the replay draws the same dropout masks. During the replay,
each floating tensor an op reads or writes gets one reduction (max |x|, which is itself non-finite
when the tensor holds inf or NaN), kept on the device; the figures are read back once after the
forward and once after the backward.

Nothing of the run changes: the replay computes gradients into a throwaway (`autograd.grad`, so
`.grad` stays as it was), puts back the buffers the forward updates (BatchNorm's running
statistics), and leaves the RNG where it found it. The model's weights, the optimizer and the
scaler are not touched.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.module_tracker import ModuleTracker

from amp_tui.core.precision import autocast_name
from amp_tui.training.compiled import eagerly, original_module
from amp_tui.training.local_fp32 import named_modules

# What `backward=` accepts: True (from the loss the forward returns), False (forward only), or
# the gradients that flowed into the forward's outputs during the step (scaled, as they flowed).
Backward = bool | torch.Tensor | Sequence[torch.Tensor]

_MODEL = "<model>"   # the root's name in the tracker: no module name of torch's can look like it


# ---- RNG ---------------------------------------------------------------------------------------

@dataclass
class RngSnapshot:
    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None = None


def rng_snapshot() -> RngSnapshot:
    """The generators' states before a step, for a replay of that step to draw the same numbers."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None   # (False without CUDA)
    return RngSnapshot(torch.get_rng_state(), cuda)


def restore_rng_snapshot(snapshot: RngSnapshot) -> None:
    torch.set_rng_state(snapshot.cpu)
    if snapshot.cuda is not None:
        torch.cuda.set_rng_state_all(snapshot.cuda)


# ---- what the tracer records -------------------------------------------------------------------

@dataclass
class OpRecord:
    """One aten op of the replay: where it ran, and max |x| of its floating inputs and outputs
    (filled in when the figures are read back; inf or NaN when the tensor held one)."""
    op: str
    module: str | None          # nearest module ("" = the root's own forward; None = outside the model)
    phase: str                  # "forward" or "backward"
    in_dtypes: list[str]
    out_dtypes: list[str]
    deliberate: bool            # a non-finite constant among its arguments (masked_fill(-inf))
    in_max: list[float] = field(default_factory=list)
    out_max: list[float] = field(default_factory=list)

    @property
    def inputs_finite(self) -> bool:
        return all(math.isfinite(v) for v in self.in_max)

    @property
    def output_finite(self) -> bool:
        return all(math.isfinite(v) for v in self.out_max)

    def first_nonfinite_output(self) -> int:
        return next(i for i, v in enumerate(self.out_max) if not math.isfinite(v))


def _floating(value: Any) -> list[torch.Tensor]:
    # A wrapper subclass (torchao's fp8 tensors) is measured through the plain tensors it holds,
    # whose ops the tracer sees too.
    return [t for t in tree_leaves(value)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0
            and not is_traceable_wrapper_subclass(t)]


def _has_nonfinite_constant(args, kwargs) -> bool:
    return any(isinstance(v, float) and not math.isfinite(v) for v in tree_leaves((args, kwargs)))


class _NamedTracker(ModuleTracker):
    """ModuleTracker naming the model's modules as `named_modules` does (through torch.compile,
    without `_orig_mod.`), so the nearest module is the one a `--fp32-modules` flag can name."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self._names = names
        self._entered: dict[str, int] = {}
        self.ops_seen = 0   # counted by the tracer: modules entered between two ops tie

    def _get_append_fn(self, name, is_bw):
        append = super()._get_append_fn(name, is_bw)

        def fn(*args) -> None:
            append(*args)
            self._entered[name] = self.ops_seen
        return fn

    def _get_mod_name(self, mod):
        name = self._names.get(id(mod))
        if name is None:
            return super()._get_mod_name(mod)
        return f"{_MODEL}.{name}" if name else _MODEL

    def nearest(self) -> str | None:
        ours = [p for p in self.parents if p == _MODEL or p.startswith(_MODEL + ".")]
        if not ours:
            return None
        # The module entered last, the deepest of those entered together: in the forward the
        # innermost; in the backward the one whose output gradient came last (modules sharing an
        # input, like q, k and v, all stay in `parents` until that input's gradient is complete;
        # a module and its last child share an output, and its hook may run after the child's).
        latest = max(ours, key=lambda p: (self._entered.get(p, -1), p.count(".")))
        return latest[len(_MODEL) + 1:]


# Ops whose output is memory not yet written (dropout's mask before bernoulli_ fills it): whatever
# it holds, inf and NaN included, is no op's doing.
_UNINITIALIZED = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
                            "empty_permuted"})


# Collectives' namespaces: a replay runs on one rank alone, where another rank would never join one.
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})


class CollectiveInReplay(RuntimeError):
    """The replayed step called a collective: on one rank alone it would wait for the others forever."""


class OpTracer(TorchDispatchMode):
    """Records every non-view aten op with max |x| of its floating tensors, kept on the device
    until `read_back()`: one host transfer per dtype and device, however many ops ran. A
    collective raises `CollectiveInReplay` instead of running."""

    def __init__(self, tracker: _NamedTracker):
        super().__init__()
        self.tracker = tracker
        self.records: list[OpRecord] = []
        self._pending: list[tuple[OpRecord, list[torch.Tensor], list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVES:
            raise CollectiveInReplay(f"the replay called {func.namespace}.{func.overloadpacket.__name__}, "
                                     "a collective the other ranks would never join (a SyncBatchNorm, or "
                                     "a loss_fn that reaches DDP's wrapper)")
        if func.is_view or func.overloadpacket.__name__ in _UNINITIALIZED:
            return func(*args, **kwargs)   # a view: its input's values, under another shape
        inputs = _floating((args, kwargs))
        mutates = func._schema.is_mutable
        in_max = [_max_abs(t) for t in inputs] if mutates else None   # before an in-place op overwrites them
        out = func(*args, **kwargs)
        self.tracker.ops_seen += 1
        outputs = _floating(out)
        if outputs:
            if in_max is None:
                in_max = [_max_abs(t) for t in inputs]
            record = OpRecord(f"{func.namespace}.{func.overloadpacket.__name__}", self.tracker.nearest(),
                              "backward" if self.tracker.is_bw else "forward",
                              [_dtype_name(t.dtype) for t in inputs], [_dtype_name(t.dtype) for t in outputs],
                              _has_nonfinite_constant(args, kwargs))
            self._pending.append((record, in_max, [_max_abs(t) for t in outputs]))
            self.records.append(record)
        return out

    def read_back(self) -> None:
        """Fill in the figures of the ops recorded since the last read-back."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for _, ins, outs in self._pending:
            for t in (*ins, *outs):
                groups.setdefault((t.dtype, t.device), []).append(t)
        values = {key: iter(torch.stack(ts).double().tolist()) for key, ts in groups.items()}
        for record, ins, outs in self._pending:
            record.in_max = [next(values[(t.dtype, t.device)]) for t in ins]
            record.out_max = [next(values[(t.dtype, t.device)]) for t in outs]
        self._pending.clear()


def _max_abs(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.element_size() == 1:   # fp8 (torchao's casts): no reduction kernels, float32 holds it exactly
        t = t.float()
    return torch.linalg.vector_norm(t, math.inf)   # NaN when t holds one, inf for inf


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def origin(records: Sequence[OpRecord]) -> OpRecord | None:
    """The first op that made a non-finite value from finite inputs; failing that, the first that
    made NaN from inputs without NaN (inf − inf, a softmax over a row of -inf only). An op given a
    non-finite constant (masked_fill with -inf) makes it on purpose and is passed over."""
    for record in records:
        if not record.output_finite and record.inputs_finite and not record.deliberate:
            return record
    for record in records:
        if any(math.isnan(v) for v in record.out_max) and not any(math.isnan(v) for v in record.in_max):
            return record
    return None


# ---- the replay --------------------------------------------------------------------------------

class NoLoss(ValueError):
    """The forward returned no loss for the backward to start from."""


def loss_in(output: Any) -> torch.Tensor | None:
    """The loss tensor itself in what a forward returned (None: none): a one-element tensor, a
    `.loss` (transformers' ModelOutput), a "loss" key, or the first element of a tuple
    (`return_dict=False`)."""
    candidates = [output, getattr(output, "loss", None)]
    if isinstance(output, dict):
        candidates.append(output.get("loss"))
    if isinstance(output, (tuple, list)) and output:
        candidates.append(output[0])
    for value in candidates:
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            return value
    return None


def loss_of(output: Any) -> torch.Tensor:
    """The loss in what a forward returned (`loss_in`), as a scalar."""
    loss = loss_in(output)
    if loss is None:
        raise NoLoss("the forward returned no loss to run the backward from; "
                         "pass the gradients of its outputs as backward=")
    return loss.reshape(())


@dataclass
class Replay:
    """What a replay saw: every op, and whether the step's loss (or outputs) and gradients were
    finite in the end."""
    records: list[OpRecord]
    step_finite: bool
    dtype: str | None
    scale: float | None


def autocast_dtype_for(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return None if dtype == torch.float32 else dtype
    name = autocast_name(dtype)   # fp8's layers run inside bf16 autocast
    return None if name == "float32" else getattr(torch, name)


def device_type_of(model: torch.nn.Module, device: torch.device | str | None) -> str:
    if device is not None:
        return torch.device(device).type
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"


@contextlib.contextmanager
def replaying(model: torch.nn.Module, device_type: str, rng: RngSnapshot | None):
    """What every replay of a step runs inside: the RNG forked (and set to `rng`, the state the
    step started from), eager even under torch.compile, with grad on, and the buffers the forward
    updated (BatchNorm's running statistics) put back after it."""
    buffers = [(b, b.detach().clone()) for b in original_module(model).buffers()]
    cuda_devices = list(range(torch.cuda.device_count())) if device_type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda_devices), eagerly(), torch.enable_grad():
            if rng is not None:
                restore_rng_snapshot(rng)
            yield
    finally:
        with torch.no_grad():
            for live, kept in buffers:
                # Only those the replay changed: a copy bumps a buffer's version, and a forward run
                # ahead of the replay (engine.py's start_step) may have saved it for its backward.
                if not torch.equal(live, kept):
                    live.copy_(kept)


def replay(model: torch.nn.Module, forward: Callable[[], Any], *, backward: Backward = True,
           scale: float | None = None, dtype: str | torch.dtype | None = None,
           device: torch.device | str | None = None, rng: RngSnapshot | None = None,
           stop_at_origin: bool = True) -> Replay:
    """Run `forward()` (under autocast in `dtype`; None or fp32: none) and the backward, traced.

    `scale` multiplies the loss before its backward, as `scaler.scale(loss)` does; gradients given
    as `backward=` are used as they are (they flowed with the step's scale in them). With
    `stop_at_origin`, a forward that already shows the origin skips the backward."""
    eager = original_module(model)
    names = {id(module): name for name, module in named_modules(model).items()}
    device_type = device_type_of(eager, device)
    autocast_dtype = autocast_dtype_for(dtype)
    params = [p for p in eager.parameters() if p.requires_grad]
    tracker = _NamedTracker(names)
    tracer = OpTracer(tracker)
    roots: list[torch.Tensor] = []
    grads: tuple = ()
    with replaying(eager, device_type, rng):
        with tracker, warnings.catch_warnings():
            # torch.compile warns that global module hooks fire once more for its wrapper:
            # the tracker's do, and name only the modules inside it.
            warnings.filterwarnings("ignore", message=".*global hooks on modules.*")
            with tracer, torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                output = forward()
            tracer.read_back()   # outside the mode, or it would trace its own reductions
            with tracer:
                roots, grad_outputs = backward_roots(output, backward, scale)
                if backward is not False and roots and params \
                        and not (stop_at_origin and origin(tracer.records)):
                    grads = torch.autograd.grad(roots, params, grad_outputs=grad_outputs, allow_unused=True)
            tracer.read_back()
    finite = [torch.isfinite(t.detach()).all() for t in (*roots, *grads) if t is not None]
    step_finite = bool(torch.stack(finite).all()) if finite else True
    return Replay(tracer.records, step_finite, None if autocast_dtype is None else _dtype_name(autocast_dtype), scale)


def backward_roots(output: Any, backward: Backward, scale: float | None):
    """The tensors to differentiate, and the gradients to start from (None: ones)."""
    roots, grads = _roots(output, backward, scale)
    # The engine runs no tensor hook of a root, so ModuleTracker would not see the backward enter
    # the module that made it: start from a view, one node further out.
    return [r.view_as(r) if r.requires_grad else r for r in roots], grads


def _roots(output: Any, backward: Backward, scale: float | None):
    if backward is False:
        return [t for t in _floating(output)], None
    if backward is True:
        loss = loss_of(output)
        if scale is not None:   # as GradScaler.scale does: times a float32 tensor
            loss = loss * torch.tensor(scale, dtype=torch.float32, device=loss.device)
        return [loss], None
    grads = [backward] if isinstance(backward, torch.Tensor) else list(backward)
    outputs = [t for t in _floating(output) if t.requires_grad]
    if len(outputs) != len(grads):
        raise ValueError(f"{len(grads)} gradients given for {len(outputs)} outputs that require grad")
    return outputs, [g.to(o.dtype) for o, g in zip(outputs, grads)]


# ---- the verdict -------------------------------------------------------------------------------

@dataclass
class OpTrace:
    """Where a replayed step first made inf or NaN (`op` None: nowhere in the replay)."""
    op: str | None = None
    op_module: str | None = None       # "" = the root's own forward; None = outside the model
    op_phase: str | None = None
    op_inputs: list[dict] = field(default_factory=list)
    op_output_dtype: str | None = None
    op_kind: str | None = None         # "overflow" or "nan"
    message: str = ""
    ops_traced: int = 0
    step_finite: bool = True

    def as_fields(self) -> dict:
        return {"op": self.op, "op_module": self.op_module, "op_phase": self.op_phase,
                "op_inputs": self.op_inputs, "op_output_dtype": self.op_output_dtype,
                "op_kind": self.op_kind, "op_message": self.message}


def json_number(value: float) -> float | str:
    """A float as JSON can hold it: finite as it is, else "inf", "-inf" or "nan"."""
    return value if math.isfinite(value) else str(value)


def number(value: float) -> str:
    """A figure for a message: whole numbers up to a million as they are (65504), else 4 digits."""
    if not math.isfinite(value):
        return str(value)
    return f"{value:.0f}" if 100 <= abs(value) < 1e6 else f"{value:.4g}"


def _and_list(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _where(module: str | None, phase: str) -> str:
    """Where an op ran: a module, the root's own code (its forward, or that forward's backward:
    "the model's own forward" alone would say forward while the phase says backward), or
    outside the model."""
    if module is None:
        return "outside the model"
    if module:
        return f"in {module}"
    return "in the backward of the model's own forward" if phase == "backward" else "in the model's own forward"


def describe(record: OpRecord) -> OpTrace:
    out = record.first_nonfinite_output()
    out_dtype = record.out_dtypes[out]
    nan = math.isnan(record.out_max[out])
    inputs = [{"dtype": d, "max": json_number(m)} for d, m in zip(record.in_dtypes, record.in_max)]
    where = _where(record.module, record.phase)
    phase = "" if record.module == "" and record.phase == "backward" else f"{record.phase}, "   # said once
    if inputs:
        dtypes = _and_list(sorted(set(record.in_dtypes), key=record.in_dtypes.index))
        shown = _and_list([number(m) for m in record.in_max[:3]]) + (" …" if len(record.in_max) > 3 else "")
        context = f"{phase}{dtypes} inputs up to {shown}"
    else:
        context = f"{phase}no floating inputs"
    if nan:
        made = ("made NaN from finite inputs" if record.inputs_finite
                else "made NaN from inputs holding inf")
    else:
        made = f"overflowed {out_dtype} (max {number(torch.finfo(getattr(torch, out_dtype)).max)})"
    return OpTrace(op=record.op, op_module=record.module, op_phase=record.phase, op_inputs=inputs,
                   op_output_dtype=out_dtype, op_kind="nan" if nan else "overflow",
                   message=f"{record.op} {where} ({context}) {made}")


def verdict(result: Replay) -> OpTrace:
    found = origin(result.records)
    if found is not None:
        trace = describe(found)
    elif any(not r.output_finite for r in result.records):
        trace = OpTrace(message="every non-finite value came in from outside the traced ops "
                                "(the inputs, the weights, or a non-finite constant)")
    else:
        trace = OpTrace(message="no op made a non-finite value in the replay"
                        + ("" if result.step_finite else ", yet the step was not finite"))
    trace.ops_traced = len(result.records)
    trace.step_finite = result.step_finite
    return trace


def trace_step(model: torch.nn.Module, forward: Callable[[], Any], *, backward: Backward = True,
               scale: float | None = None, dtype: str | torch.dtype | None = None,
               device: torch.device | str | None = None, rng: RngSnapshot | None = None) -> OpTrace:
    """Replay a failing step and name the first op that made inf or NaN.

    `forward()` runs the step without autocast of its own (`loss_fn(model, batch)`, or
    `model(*kept_inputs)`); the replay puts it under autocast in `dtype`. `backward`: True runs
    the backward from the loss it returns (times `scale`), gradients given run it from the
    model's outputs, False skips it. `rng`: the snapshot taken before the step."""
    return verdict(replay(model, forward, backward=backward, scale=scale, dtype=dtype, device=device, rng=rng))
