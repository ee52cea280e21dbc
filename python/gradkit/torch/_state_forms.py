"""The forms an optimizer's per-parameter state takes, and moving state between them.

Moments ("exp_avg", "exp_avg_sq", amsgrad's "max_exp_avg_sq"):
- "float32": float32 (float64 for float64 parameters), as torch.optim keeps them;
- "bfloat16": bfloat16, half the bytes;
- "int8": 8-bit blockwise (docs/ops.md, "8-bit moments"): uint8 codes shaped like
  the parameter and a float32 absmax per block of gradkit.QUANT_BLOCK elements,
  "<name>_absmax". No amsgrad. Parameters of fewer than `min_8bit_size` elements
  (biases, norms: a negligible share of the memory) keep float32 moments, as
  bitsandbytes does: a small tensor's few blocks put unrelated values under one
  absmax, and a second moment rounded to zero turns its update into m / eps.
- "int4": 4-bit blockwise (docs/ops.md, "4-bit moments"): a flat uint8 tensor of
  gradkit.quant4_bytes(numel) bytes (two codes a byte) and a float32 absmax per
  block of gradkit.QUANT4_BLOCK elements, "<name>_absmax4". No amsgrad; parameters
  of fewer than `min_4bit_size` elements keep float32 moments.

Masters of float16/bfloat16 parameters:
- "float32": "master_param", float32, the parameter its rounded copy;
- "remainder" (bfloat16 parameters only): "weight_remainder", int16: the parameter
  and its remainder give the float32 master back bit for bit (docs/ops.md, "the
  remainder master"), 2 bytes instead of 4.

DTensor parameters (FSDP2) take every form: the state is made like the parameter
(DTensors), except a quantized moment's absmax, a plain tensor over the rank's own
blocks (they start where the local shard starts), and 4-bit codes, a plain flat
tensor of the rank's own (two codes a byte have no shape to shard); state_dict()
hands 8- and 4-bit moments out decoded to float32 and remainder masters joined into
float32 masters (StateForm.portable).

Every conversion goes through gradkit's own encoders (quantize_blockwise,
split_masters, ...): state loaded from another form (torch.optim's float32
state, a checkpoint of another gradkit configuration) is what the kernels
themselves would have made of it.
"""
import torch

import gradkit
from gradkit.torch._dtensor import DTensor, is_dtensor, local

MOMENT_FORMS = ("float32", "bfloat16", "int8", "int4")
MASTER_FORMS = ("float32", "remainder")
LOW_PRECISION = (torch.float16, torch.bfloat16)
_CODES = {"exp_avg": gradkit.QuantCode.signed_dynamic, "exp_avg_sq": gradkit.QuantCode.unsigned_dynamic,
          "max_exp_avg_sq": gradkit.QuantCode.unsigned_dynamic}


# A parameter's state holding 4-bit codes says which map its second moment's codes are
# on: INT4_MAP_KEY = INT4_DE0. State format 3 (docs/state-format.md) keeps them on the
# linear map (i + 1) / 16, whose codes stand for other values than DE-0's:
# 4-bit codes without the mark are refused rather than misread. The mark is an int (a
# flattened optimizer state dict of torch.distributed.checkpoint takes tensors, ints and
# floats), and the optimizer's own state keeps it beside the codes: a flattened state
# dict is rebuilt from the loading optimizer's state keys and groups, so a mark that only
# the saved dict held would be lost on the way back.
INT4_MAP_KEY = "int4_second_moment_map"
INT4_DE0 = 1


def _holds_4bit_codes(state):
    return any(torch.is_tensor(v) and k.endswith("_absmax4") for k, v in state.items())


def mark_int4_map(state):
    """Gives a parameter's state the mark if it holds 4-bit codes, and takes it away if not."""
    if _holds_4bit_codes(state):
        state[INT4_MAP_KEY] = INT4_DE0
    else:
        state.pop(INT4_MAP_KEY, None)
    return state


def check_int4_map(state_dict):
    """Raises, before anything is loaded, if a parameter's state in state_dict holds 4-bit
    codes without INT4_DE0."""
    for key, state in state_dict.get("state", {}).items():
        if _holds_4bit_codes(state) and state.get(INT4_MAP_KEY) != INT4_DE0:
            raise ValueError(f"state_dict's state {key!r} holds 4-bit moments with {INT4_MAP_KEY!r} "
                             f"{state.get(INT4_MAP_KEY)!r}, expected {INT4_DE0} (DE-0): it was saved by a gradkit "
                             "whose 4-bit second moment was on the linear map, whose codes stand for other values "
                             "than this gradkit's. Load it with the gradkit that saved it and save "
                             "float32_state_dict(), which loads here")


# The largest step count a state may hold: what a float64 counts exactly (torch saves steps as
# float32 tensors, exact to 2^24; gradkit's counters on the device are int64).
MAX_STEP = 2 ** 53


def step_count(step, where):
    """A state's "step" (a number or a one-element tensor, as torch saves it) as an int;
    ValueError or TypeError naming `where` unless it is a whole number in [0, MAX_STEP]."""
    if torch.is_tensor(step):
        if step.numel() != 1:
            raise ValueError(f"{where}['step'] is a tensor of shape {tuple(step.shape)}, expected one element")
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        raise TypeError(f"{where}['step'] is {step!r}, expected a whole number >= 0 (or a tensor of one)")
    if not (step == step and 0 <= step <= MAX_STEP and step == int(step)):
        raise ValueError(f"{where}['step'] is {step!r}, expected a whole number in [0, 2^53] (the steps taken)")
    return int(step)


def _shapes_of(p):
    """The shapes a state tensor of p may have: p's, or its local shard's (DTensors)."""
    return {tuple(p.shape), tuple(local(p).shape)}


def check_moments(p, names, state, where):
    """Raises ValueError naming `where` and the key unless `state` holds each moment of `names`
    in a form StateForm.convert takes (floating point, 8-bit or 4-bit codes with their absmax),
    shaped for p, and any master shaped like p: what loading checks before it replaces a state."""
    for name in names:
        if name not in state:
            raise ValueError(f"{where} has no {name!r} (it holds {', '.join(map(repr, state)) or 'nothing'}); "
                             "expected the state of a gradkit optimizer of this kind or of torch.optim's counterpart")
        t = state[name]
        if not torch.is_tensor(t):
            raise TypeError(f"{where}[{name!r}] is a {type(t).__name__}, expected a tensor")
        if _is_4bit(state, name):
            numels = {gradkit.quant4_bytes(local(p).numel()), gradkit.quant4_bytes(p.numel())}
            if t.numel() not in numels:
                raise ValueError(f"{where}[{name!r}] holds {t.numel()} bytes of 4-bit codes, expected "
                                 f"{min(numels)} for a parameter of shape {tuple(p.shape)}")
            continue
        if not (t.is_floating_point() or _is_8bit(state, name)):
            raise ValueError(f"{where}: {name!r} is {t.dtype} without {absmax_name(name)!r}; expected floating-point "
                             "moments or uint8 codes with their float32 absmax")
        if tuple(t.shape) not in _shapes_of(p):
            raise ValueError(f"{where}[{name!r}] has shape {tuple(t.shape)}, expected {tuple(p.shape)} (the "
                             "parameter's)")
    for key in ("master_param", "weight_remainder"):
        t = state.get(key)
        if torch.is_tensor(t) and tuple(t.shape) not in _shapes_of(p):
            raise ValueError(f"{where}[{key!r}] has shape {tuple(t.shape)}, expected {tuple(p.shape)} (the "
                             "parameter's)")


def absmax_name(name):
    return name + "_absmax"


def absmax4_name(name):
    return name + "_absmax4"


def _is_absmax_key(key, names):
    """Whether `key` is the absmax of one of `names`, 8- or 4-bit."""
    return any(key in (absmax_name(n), absmax4_name(n)) for n in names)


class StateForm:
    """How an optimizer stores its moments and masters (see the module's text)."""

    __slots__ = ("moments", "master", "min_8bit_size", "min_4bit_size")

    def __init__(self, moments="float32", master="float32", min_8bit_size=4096, min_4bit_size=4096):
        if moments not in MOMENT_FORMS:
            raise ValueError(f"moments is {moments!r}, expected one of {', '.join(map(repr, MOMENT_FORMS))}")
        if master not in MASTER_FORMS:
            raise ValueError(f"master is {master!r}, expected one of {', '.join(map(repr, MASTER_FORMS))}")
        for name, value in (("min_8bit_size", min_8bit_size), ("min_4bit_size", min_4bit_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} is {value!r}, expected an integer >= 0")
        self.moments = moments
        self.master = master
        self.min_8bit_size = min_8bit_size
        self.min_4bit_size = min_4bit_size

    def __getstate__(self):
        return (self.moments, self.master, self.min_8bit_size, self.min_4bit_size)

    def __setstate__(self, state):
        # A form pickled before 4-bit moments has three fields.
        self.moments, self.master, self.min_8bit_size, self.min_4bit_size = (tuple(state) + (4096,))[:4]

    def __repr__(self):
        return (f"StateForm(moments={self.moments!r}, master={self.master!r}, min_8bit_size={self.min_8bit_size}, "
                f"min_4bit_size={self.min_4bit_size})")

    # -- what the parameters allow ----------------------------------------------

    def check(self, params, amsgrad):
        """Refuses a form the parameters cannot take, naming the argument."""
        dtypes = {p.dtype for p in params}
        if self.moments != "float32" and torch.float64 in dtypes:
            raise TypeError(f"moments={self.moments!r} with float64 parameters; float64 parameters take "
                            "moments='float32' (float64 moments) only")
        if self.moments in ("int8", "int4") and amsgrad:
            raise ValueError(f"amsgrad=True with moments={self.moments!r}; {self.moments[3:]}-bit moments have no "
                             "amsgrad (use moments='float32')")
        if self.master == "remainder" and dtypes != {torch.bfloat16}:
            raise TypeError(f"master='remainder' with parameters of dtypes {sorted(str(d) for d in dtypes)}; it "
                            "needs bfloat16 parameters (a float16 weight cannot carry its float32 master in 16 more "
                            "bits; float32 parameters are their own masters)")

    def bits(self, p):
        """8 or 4 if p's moments are 8- or 4-bit, else 0 (for a DTensor, decided by its whole
        size, so that every rank decides alike)."""
        if self.moments == "int8" and p.numel() >= self.min_8bit_size:
            return 8
        if self.moments == "int4" and p.numel() >= self.min_4bit_size:
            return 4
        return 0

    def quantized(self, p):
        """Whether p's moments are 8- or 4-bit."""
        return self.bits(p) != 0

    def absmax_key(self, p, name):
        """The state key of the absmax of p's moment `name` (p's moments quantized)."""
        return absmax4_name(name) if self.bits(p) == 4 else absmax_name(name)

    def moment_dtype(self, p):
        if self.quantized(p):
            return torch.uint8
        if self.moments == "bfloat16":
            return torch.bfloat16
        return torch.float32 if p.dtype in LOW_PRECISION else p.dtype

    def master_key(self, p):
        """The state key of p's master ("master_param", "weight_remainder"), or None."""
        if p.dtype not in LOW_PRECISION:
            return None
        return "weight_remainder" if self.master == "remainder" else "master_param"

    # -- making and converting state ---------------------------------------------

    def new_states(self, entries):
        """Zero moments and p's master (from p) in this form, for each (p, names, state) of
        `entries` (the names of p's moments; state filled in place). The low-bit state's
        plain tensors (8- and 4-bit codes, their absmax, remainders) of every entry are cut
        from one buffer per device and dtype (_ZeroArena): made one by one, torch's caching
        allocator rounds up each tensor's block, which adds 0.17 to 0.37 bytes per
        parameter to 4-bit moments' 1.07 on the GPT-2 list (measured:
        bench/log/2026-11-27.md, "low-bit state from one buffer per dtype"). They are
        views of that buffer: disjoint, and torch.save writes the buffer once for a whole
        state dict (torch.distributed.checkpoint copies each view alone)."""
        arena = _ZeroArena()
        layouts = [self._plain_zeros(p, names) for p, names, _ in entries]
        for layout in layouts:
            for _, numel, dtype, device, _ in layout:
                arena.reserve(numel, dtype, device)
        arena.allocate()
        for (p, names, state), layout in zip(entries, layouts):
            made = {}
            for key, numel, dtype, device, shape in layout:
                t = arena.take(numel, dtype, device)
                made[key] = t if shape is None else t.view(shape)
            for name in names:
                state[name] = made.pop(name, None)
                if state[name] is None:
                    state[name] = torch.zeros_like(p, dtype=self.moment_dtype(p), memory_format=torch.contiguous_format)
                for key in (absmax_name(name), absmax4_name(name)):
                    if key in made:
                        state[key] = made.pop(key)
            mark_int4_map(state)
            key = self.master_key(p)
            if key == "master_param":
                state[key] = p.detach().to(torch.float32).contiguous()
            elif key == "weight_remainder":
                # The master is the parameter itself: what rounding took away is nothing.
                state[key] = made.pop(key, None)
                if state[key] is None:
                    state[key] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.contiguous_format)

    def _plain_zeros(self, p, names):
        """p's zero state that new_states cuts from its buffers: (key, numel, dtype, device,
        shape or None for flat) of its 8- and 4-bit codes and absmax and its remainder,
        each a plain tensor (of the local shard for a DTensor; a DTensor's 8-bit codes and
        remainder are DTensors, made on their own)."""
        bits, shard, plain = self.bits(p), local(p), not is_dtensor(p)
        n, device = shard.numel(), shard.device
        out = []
        for name in names:
            if bits == 4:
                codes, blocks = _low_bit_numels(n, 4)
                out.append((name, codes, torch.uint8, device, None))
                out.append((absmax4_name(name), blocks, torch.float32, device, None))
            elif bits == 8:
                codes, blocks = _low_bit_numels(n, 8)
                if plain:
                    out.append((name, codes, torch.uint8, device, p.shape))
                out.append((absmax_name(name), blocks, torch.float32, device, None))
        if plain and self.master_key(p) == "weight_remainder":
            out.append(("weight_remainder", n, torch.int16, device, p.shape))
        return out

    def convert(self, p, names, state):
        """Brings a loaded state (any form, or torch.optim's) into this form, in place. May
        write p: a float32 master loaded into the remainder form sets p to its rounding."""
        self.convert_moments(p, names, state)
        mark_int4_map(state)
        self._convert_master(p, state)

    def convert_moments(self, p, names, state):
        """convert() for the moments alone (p only gives their shape, dtype and device)."""
        for name in names:
            bits = self.bits(p)
            if (bits == 8 and _is_8bit(state, name)) or (bits == 4 and _is_4bit(state, name)):
                key = self.absmax_key(p, name)
                state[name] = _on(state[name], p, torch.uint8)
                state[key] = _on(state[key], p, torch.float32)
                continue
            values = _float_moment(state, name, p)
            state.pop(absmax_name(name), None)
            state.pop(absmax4_name(name), None)
            if bits == 8:
                codes = torch.empty_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
                absmax = _new_absmax(p)
                gradkit.quantize_blockwise(_CODES[name], local(_on(values, p, torch.float32)), local(codes), absmax)
                state[name], state[absmax_name(name)] = codes, absmax
            elif bits == 4:
                codes, absmax = _new_4bit(p)
                gradkit.quantize_blockwise4(_CODES[name], local(_on(values, p, torch.float32)).reshape(-1), codes,
                                            absmax)
                state[name], state[absmax4_name(name)] = codes, absmax
            else:
                state[name] = _on(values, p, self.moment_dtype(p))

    def _convert_master(self, p, state):
        key = self.master_key(p)
        if key == "weight_remainder" and "weight_remainder" in state and "master_param" not in state:
            state[key] = _on(state[key], p, torch.int16)
            return
        master = float_master(p, state)
        state.pop("master_param", None)
        state.pop("weight_remainder", None)
        if key == "master_param":
            state[key] = master
        elif key == "weight_remainder":
            # p becomes its master rounded (unchanged when the master came from p).
            state[key] = torch.empty_like(p, dtype=torch.int16, memory_format=torch.contiguous_format)
            gradkit.split_masters(local(master), local(p.detach()), local(state[key]))

    def to_float32(self, p, names, state):
        """A copy of p's state as the float32 form has it (torch.optim's layout plus
        "master_param" for float16/bfloat16 parameters)."""
        out = {k: v for k, v in state.items()
               if k not in names and k not in ("master_param", "weight_remainder", INT4_MAP_KEY)
               and not _is_absmax_key(k, names)}
        for name in names:
            out[name] = _on(_float_moment(state, name, p), p, torch.float32 if p.dtype != torch.float64 else p.dtype,
                            copy=True)
        if p.dtype in LOW_PRECISION:
            out["master_param"] = float_master(p, state)
        return out

    def portable(self, p, names, state):
        """A copy of p's state with 8- and 4-bit moments decoded to float32 and a remainder master
        joined into a float32 "master_param" (bfloat16 moments stay): how a DTensor
        parameter's state leaves state_dict(). An absmax covers the rank's own blocks, which
        torch.distributed.checkpoint could not reshard, and int16 is no NCCL or gloo type,
        so a full_tensor() of a remainder would fail; float32 DTensors shaped like the
        parameter go everywhere. load_state_dict encodes them again: the same codes,
        absmax and remainders when the sharding is the same (a decoded block encodes back
        to itself; the parameter is its master's rounding)."""
        out = {k: v for k, v in state.items() if not _is_absmax_key(k, names) and k != INT4_MAP_KEY}
        for name in names:
            if _is_8bit(state, name) or _is_4bit(state, name):
                out[name] = _float_moment(state, name, p)
        if "weight_remainder" in out:
            del out["weight_remainder"]
            out["master_param"] = float_master(p, state)
        return out

    def portable_differs(self, p):
        """Whether p's state leaves state_dict() in another form (portable) than it is kept in."""
        return is_dtensor(p) and (self.quantized(p) or self.master_key(p) == "weight_remainder")


def _low_bit_numels(n, bits):
    """(codes, absmax) element counts of one moment of n elements in the 8- or 4-bit form:
    8-bit codes one a byte, 4-bit two a byte; one float32 absmax a block (a DTensor's local
    shard has blocks of its own, starting where the shard starts)."""
    if bits == 4:
        return gradkit.quant4_bytes(n), gradkit.quant4_blocks(n)
    return n, gradkit.quant_blocks(n)


def _new_absmax(p):
    """Zero absmax for p's 8-bit blocks, a plain tensor (of this rank's shard for a DTensor)."""
    shard = local(p)
    return torch.zeros(_low_bit_numels(shard.numel(), 8)[1], dtype=torch.float32, device=shard.device)


def _new_4bit(p):
    """Zero 4-bit codes (flat, two a byte) and absmax for p, plain tensors (for a
    DTensor, of the local shard)."""
    shard = local(p)
    codes, blocks = _low_bit_numels(shard.numel(), 4)
    return (torch.zeros(codes, dtype=torch.uint8, device=shard.device),
            torch.zeros(blocks, dtype=torch.float32, device=shard.device))


class _ZeroArena:
    """Flat zero tensors cut from one buffer per (device, dtype): reserve() each first,
    allocate(), then take() the same requests in the same order.
    Each tensor starts a multiple of 256 bytes past the buffer's start, which torch aligns
    (64 bytes on the CPU, 512 on CUDA): as aligned as an allocation of its own (the
    kernels' vector loads want 16)."""

    ALIGN = 256

    def __init__(self):
        self._sizes = {}
        self._buffers = {}
        self._at = {}

    def _span(self, numel, dtype):
        size = torch.empty((), dtype=dtype).element_size()
        return -(-numel * size // self.ALIGN) * self.ALIGN // size

    def reserve(self, numel, dtype, device):
        key = (torch.device(device), dtype)
        self._sizes[key] = self._sizes.get(key, 0) + self._span(numel, dtype)

    def allocate(self):
        for key, n in self._sizes.items():
            self._buffers[key] = torch.zeros(n, dtype=key[1], device=key[0])
            self._at[key] = 0

    def take(self, numel, dtype, device):
        key = (torch.device(device), dtype)
        at = self._at[key]
        self._at[key] = at + self._span(numel, dtype)
        return self._buffers[key][at:at + numel]


def _like(values, p):
    """`values` (p's local shape) as p is: a DTensor with p's mesh and placements, or p's shape."""
    if is_dtensor(p):
        return DTensor.from_local(values.view(local(p).shape), p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return values.view(p.shape)


def _on(t, p, dtype, copy=False):
    """t as dtype on p's device, contiguous; a new tensor if copy."""
    return t.to(device=p.device, dtype=dtype, copy=copy).contiguous()


def _is_8bit(state, name):
    return name in state and state[name].dtype == torch.uint8 and absmax_name(name) in state


def _is_4bit(state, name):
    return name in state and state[name].dtype == torch.uint8 and absmax4_name(name) in state


def _float_moment(state, name, p):
    """state[name] as floating point (decoded if it is 8-bit, shaped as p is); raises if the
    state has no such moment or holds it in a form gradkit does not know."""
    if name not in state:
        raise ValueError(f"the state of a parameter has no '{name}'; expected the state of a gradkit optimizer "
                         "or of torch.optim's counterpart")
    t = state[name]
    if t.is_floating_point():
        return t
    if _is_4bit(state, name):
        values = torch.empty(local(p).numel(), dtype=torch.float32, device=t.device)
        gradkit.dequantize_blockwise4(_CODES[name], t.contiguous(), state[absmax4_name(name)].to(torch.float32)
                                      .contiguous(), values)
        return _like(values, p)
    key = absmax_name(name)
    if t.dtype != torch.uint8 or key not in state:
        raise ValueError(f"the state's '{name}' is {t.dtype} without '{key}'; expected floating-point moments or "
                         "uint8 codes with their float32 absmax")
    return _like(_decoded(name, local(t), local(state[key])), p)


def _decoded(name, codes, absmax):
    values = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    gradkit.dequantize_blockwise(_CODES[name], codes.contiguous(), absmax.to(torch.float32).contiguous(), values)
    return values


def float_master(p, state):
    """p's float32 master from whichever form the state holds (None if it holds none)."""
    if p.dtype not in LOW_PRECISION:
        return None
    if "master_param" in state:
        return _on(state["master_param"], p, torch.float32)
    if "weight_remainder" in state:
        master = torch.empty_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        gradkit.join_masters(local(p.detach()), local(_on(state["weight_remainder"], p, torch.int16)), local(master))
        return master
    return p.detach().to(torch.float32).contiguous()
