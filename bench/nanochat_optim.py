"""nanochat's optimizer and parameter shapes for the benchmark and dev/muon's check:
nanochat/optim.py loaded from a file given on the command line (never copied into
this repository), and its GPT's parameters and param groups rebuilt from
nanochat/gpt.py's layout (no forward: the step needs only the tensors).

nanochat's GPT for depth d: model_dim = 64 d rounded up to a multiple of head_dim
(128), heads = model_dim / 128, as many key/value heads; per layer c_q, c_k, c_v,
c_proj (model_dim x model_dim), mlp.c_fc (4 model_dim x model_dim), mlp.c_proj
(model_dim x 4 model_dim); value embeddings (vocab x model_dim) and a ve_gate
(heads x 12) on the layers i with i % 2 == (d - 1) % 2; wte and lm_head
(vocab x model_dim); resid_lambdas, x0_lambdas (d), smear_gate (1 x 24),
smear_lambda, backout_lambda (1). wte and the value embeddings are bfloat16
(COMPUTE_DTYPE on a bf16 GPU), the rest float32. setup_optimizer's groups: six
AdamW groups (lm_head, wte, value embeddings, resid, x0, smear), then one Muon group
per matrix shape.
"""
import importlib.util
import sys
import types

import torch


def load_nanochat_optim(path, compute_dtype=torch.bfloat16):
    """nanochat/optim.py at `path` as a module, with the `nanochat.common` it imports stubbed
    (COMPUTE_DTYPE only)."""
    package = sys.modules.setdefault("nanochat", types.ModuleType("nanochat"))
    package.__path__ = []
    common = types.ModuleType("nanochat.common")
    common.COMPUTE_DTYPE = compute_dtype
    sys.modules["nanochat.common"] = common
    spec = importlib.util.spec_from_file_location("nanochat.optim", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["nanochat.optim"] = module
    spec.loader.exec_module(module)
    return module


def has_ve(layer, layers):
    return layer % 2 == (layers - 1) % 2


def model_dim(depth, aspect_ratio=64, head_dim=128):
    base = depth * aspect_ratio
    return -(-base // head_dim) * head_dim


def nanochat_params(depth, vocab=32768, aspect_ratio=64, head_dim=128, device="cpu", seed=0,
                    embedding_dtype=torch.bfloat16):
    """nanochat's GPT's parameters for `depth` as {kind: [tensors]} (kinds: matrix, lm_head,
    wte, value_embeds, resid, x0, smear), seeded random values at nanochat's init scales."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dim = model_dim(depth, aspect_ratio, head_dim)
    heads = dim // head_dim

    def make(shape, std, dtype=torch.float32):
        t = torch.randn(shape, generator=g) * std
        return torch.nn.Parameter(t.to(device=device, dtype=dtype))

    s = dim ** -0.5
    matrices = []
    for layer in range(depth):
        matrices += [make((dim, dim), s) for _ in range(4)]  # c_q, c_k, c_v, c_proj
        matrices += [make((4 * dim, dim), 0.4 * s), make((dim, 4 * dim), s)]
        if has_ve(layer, depth):
            matrices.append(make((heads, 12), 0.01))  # ve_gate
    return {
        "matrix": matrices,
        "lm_head": [make((vocab, dim), 0.001)],
        "wte": [make((vocab, dim), 0.8, embedding_dtype)],
        "value_embeds": [make((vocab, dim), s, embedding_dtype) for i in range(depth) if has_ve(i, depth)],
        "resid": [make((depth,), 1.0)],
        "x0": [make((depth,), 0.1)],
        "smear": [make((1, 24), 0.01), make((1,), 0.1), make((1,), 0.2)],
    }


def nanochat_param_groups(params, dim, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.2,
                          scalar_lr=0.5):
    """setup_optimizer's param groups (nanochat/gpt.py) over nanochat_params' tensors."""
    scale = (dim / 768) ** -0.5
    groups = [
        dict(kind="adamw", params=params["lm_head"], lr=unembedding_lr * scale, betas=(0.8, 0.96), eps=1e-10,
             weight_decay=0.01),
        dict(kind="adamw", params=params["wte"], lr=embedding_lr * scale, betas=(0.8, 0.995), eps=1e-10,
             weight_decay=0.001),
        dict(kind="adamw", params=params["value_embeds"], lr=embedding_lr * scale * 0.5, betas=(0.8, 0.995),
             eps=1e-10, weight_decay=0.01),
        dict(kind="adamw", params=params["resid"], lr=scalar_lr * 0.01, betas=(0.8, 0.95), eps=1e-10,
             weight_decay=0.05),
        dict(kind="adamw", params=params["x0"], lr=scalar_lr, betas=(0.96, 0.95), eps=1e-10, weight_decay=0.0),
        dict(kind="adamw", params=params["smear"], lr=0.2, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0),
    ]
    matrices = params["matrix"]
    for shape in sorted({p.shape for p in matrices}):
        groups.append(dict(kind="muon", params=[p for p in matrices if p.shape == shape], lr=matrix_lr,
                           momentum=0.95, ns_steps=5, beta2=0.9, weight_decay=weight_decay))
    for group in groups:
        group["initial_lr"] = group["lr"]
    return groups


def clone_params(params):
    """A copy of nanochat_params' dict (the same values, new Parameters)."""
    return {k: [torch.nn.Parameter(p.detach().clone()) for p in ps] for k, ps in params.items()}
