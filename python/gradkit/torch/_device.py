"""Where a list of torch tensors lives, and the stream gradkit enqueues on."""
import torch

import gradkit


_DTYPES = {torch.float32: gradkit.DType.f32, torch.float16: gradkit.DType.f16,
           torch.bfloat16: gradkit.DType.bf16, torch.float64: gradkit.DType.f64}


def gradkit_dtype(dtype, what):
    """gradkit's DType for a torch dtype; TypeError naming `what` otherwise."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError(f"{what} has dtype {dtype}, expected float32, float16, bfloat16 or float64") from None


def device_name(device):
    """'cpu' or 'cuda:N', as gradkit's constructors take devices."""
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    if device.type == "cpu":
        return "cpu"
    raise TypeError(f"tensors on {device} are not supported; expected the CPU or a CUDA device")


def common_device(tensors, what):
    """The one device of `tensors`; TypeError naming `what` if they differ."""
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != device:
            raise TypeError(f"{what}[{i}] is on {t.device}, expected {device} (that of {what}[0]): "
                            "one gradkit optimizer steps the parameters of one device")
    return device


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_handle(device):
    """The caller's current CUDA stream on `device` as an int (0 on the CPU).
    torch's raw accessor where it has one: it skips making a Stream object,
    a few microseconds of every step."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream
