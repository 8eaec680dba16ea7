"""A GPU or an Apple GPU simulated on the CPU, for the tests of what runs there.

PyTorch's ``FakeTensorMode`` lets tensors claim ``cuda`` or ``mps`` on a CPU-only build, but
its tensors carry no numbers, and on this build autograd aborts the process when it records
an operation on such a device (it asks C++ for a device guard that is not compiled in). So
the tests use real CPU tensors that *claim* the device instead:

* factories with ``device="cuda:0"`` and ``.to(...)``/``.cuda()`` onto it make CPU tensors
  that this simulation remembers as living on the device, and ``.device``, ``.is_cuda`` and
  ``.is_mps`` say so; whatever an operation computes from them lives there too;
* an operation that mixes such a tensor with a CPU tensor of one or more dimensions raises
  :class:`DeviceMix`, as the real device would (a 0-dim CPU tensor is a scalar PyTorch
  moves for you); moving to the CPU (``.to("cpu")``, ``.cpu()``) is allowed;
* ``refuse_float64`` (MPS) raises on any float64 result on the device, and ``pin_memory``
  is refused off CUDA (nothing else pins) and for a tensor already on the device, as CUDA does.

What it cannot show: the device's kernels, numerics, autocast and speed (autocast keys on
the tensors' real device, the CPU), its random generators, ``torch.cuda.*`` calls (tests
patch what they need), nor code that builds a model with ``.to(device)`` of a Module whose
parameters it must recognise (tests move models with :meth:`SimulatedDevice.move`).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary


class DeviceMix(AssertionError):
    """What the real device would have refused."""


class SimulatedDevice:
    """``with SimulatedDevice("cuda:0") as gpu: model = gpu.move(model); ...``"""

    def __init__(self, device="cuda:0", refuse_float64: bool | None = None):
        self.device = torch.device(device)
        self.refuse_float64 = self.device.type == "mps" if refuse_float64 is None else refuse_float64
        self._on = WeakTensorKeyDictionary()
        self.pinned = 0  # tensors put in pinned (page-locked) host memory
        self._modes = []

    def holds(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self._on

    def tag(self, out):
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._on[t] = True
        return out

    def untag(self, t):
        self._on.pop(t, None)
        return t

    def move(self, model: torch.nn.Module) -> torch.nn.Module:
        """Put ``model``'s parameters, gradients and buffers on the device."""
        for t in [*model.parameters(), *model.buffers()]:
            self.tag(t)
        return model

    def __enter__(self):
        self._modes = [_Functions(self), _Dispatch(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def _accessor(func, attribute: str, kind: str) -> bool:
    return getattr(func, "__name__", "") == kind and getattr(func, "__self__", None) is getattr(
        torch._C.TensorBase, attribute
    )


def _is(func, *names) -> bool:
    return any(func in (getattr(torch.Tensor, n), getattr(torch._C.TensorBase, n)) for n in names)


class _Functions(TorchFunctionMode):
    def __init__(self, sim: SimulatedDevice):
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        sim = self.sim
        if _accessor(func, "device", "__get__"):
            return sim.device if sim.holds(args[0]) else func(*args)
        if _accessor(func, "is_cuda", "__get__"):
            return sim.device.type == "cuda" if sim.holds(args[0]) else func(*args)
        if _accessor(func, "is_mps", "__get__"):
            return sim.device.type == "mps" if sim.holds(args[0]) else func(*args)
        if _accessor(func, "data", "__set__"):
            func(*args)
            sim.tag(args[0]) if sim.holds(args[1]) else sim.untag(args[0])
            return None
        if _is(func, "pin_memory"):
            if sim.device.type != "cuda":
                raise DeviceMix(f"pin_memory() for a {sim.device.type} device: only CUDA copies gain from pinning")
            if sim.holds(args[0]):
                raise DeviceMix("cannot pin a tensor on the device: only dense CPU tensors can be pinned")
            sim.pinned += 1
            return args[0]
        if _is(func, "to", "cuda", "cpu"):
            return self._move(func, args, kwargs)
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == sim.device.type:
            kwargs["device"] = "cpu"
            return sim.tag(_refused_dtype(sim, func, func(*args, **kwargs)))
        return func(*args, **kwargs)

    def _move(self, func, args, kwargs):
        sim, t = self.sim, args[0]
        target, dtype = kwargs.get("device"), kwargs.get("dtype")
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                target = a
            elif isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, torch.Tensor):
                target, dtype = (sim.device if sim.holds(a) else a.device), a.dtype
        if _is(func, "cuda"):
            target = sim.device
        if _is(func, "cpu"):
            target = "cpu"
        extra = {k: v for k, v in kwargs.items() if k in ("memory_format", "copy")}
        if dtype is not None:
            extra["dtype"] = dtype
        out = t.to(**extra) if extra else t
        if target is None:
            return sim.tag(out) if sim.holds(t) else out
        kind = torch.device(target).type
        if kind == sim.device.type:
            return sim.tag(out if out is not t or sim.holds(t) else t.clone())
        if kind == "cpu":
            return sim.untag(out.clone() if out is t and sim.holds(t) else out)
        raise DeviceMix(f"a tensor moved to {target}, while this run's device is {sim.device}")


class _Dispatch(TorchDispatchMode):
    def __init__(self, sim: SimulatedDevice):
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on = any(sim.holds(t) for t in tensors)
        off = [tuple(t.shape) for t in tensors if not sim.holds(t) and t.dim() > 0]
        if on and off and func is not torch.ops.aten.copy_.default:
            raise DeviceMix(f"{func} mixes tensors on {sim.device} with tensors on the CPU of shapes {off[:3]}")
        out = func(*args, **kwargs)
        if on:
            sim.tag(_refused_dtype(sim, func, out))
        return out


def _refused_dtype(sim: SimulatedDevice, func, out):
    for t in tree_flatten(out)[0]:
        if sim.refuse_float64 and isinstance(t, torch.Tensor) and t.dtype == torch.float64:
            raise DeviceMix(
                f"{getattr(func, '__name__', func)} made a float64 tensor on {sim.device}, which has no float64"
            )
    return out
