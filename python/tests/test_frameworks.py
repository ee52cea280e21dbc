"""gradkit.torch's optimizers in the frameworks people train with, on the CPU,
with tiny models and data built here (nothing is downloaded):

- Hugging Face Trainer with optimizers=(gradkit.torch.AdamW, a scheduler) and
  its default gradient clipping: a run resumed from its step-4 checkpoint by a
  new Trainer ends bit for bit where the straight run does, and close to
  torch.optim.AdamW's run; the same resume with 4-bit moments (AdamW's, Lamb's);
- Lightning, configure_optimizers returning a gradkit optimizer and a
  scheduler (with and without gradient_clip_val), against the same loop
  written by hand, bit for bit; a resumed fit too;
- accelerate, Accelerator.prepare with a gradkit optimizer (clipping, gradient
  accumulation, save_state / load_state), against the loop by hand, bit for
  bit.

Each framework is skipped where it is not installed: Debian's torch 1.13 (CI's
oldest) has none; scripts/python-env pins the versions tested with torch 2.11.
docs/python.md ("Using gradkit with Hugging Face Trainer, Lightning and
accelerate") says what was found."""
import os

import pytest

# Nothing here may reach the network (the Hub, telemetry): set before the frameworks are imported.
for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_name, "1")

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import gradkit.torch as gt  # noqa: E402
from tolerances import TORCH_100_STEPS  # noqa: E402

LR = 1e-2
WEIGHT_DECAY = 0.1
CLIP = 1.0  # Hugging Face Trainer's default max_grad_norm; the other checks clip at it too


def assert_bitwise_equal(a_params, b_params):
    a_params, b_params = list(a_params), list(b_params)
    assert len(a_params) == len(b_params)
    for i, (a, b) in enumerate(zip(a_params, b_params)):
        assert torch.equal(a.detach(), b.detach()), f"parameter {i} differs"


def steps_taken(optimizer):
    """The step count of every parameter in a (gradkit) optimizer's state_dict."""
    return {float(s["step"]) for s in optimizer.state_dict()["state"].values()}


def hf_causal_lm(transformers):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)


def hf_tokens():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (32, 16), generator=g)
    return [{"input_ids": t, "labels": t} for t in tokens]  # 8 batches of 4: one epoch


# -- a small classifier, for Lightning and accelerate ------------------------------------------

BATCHES = 8  # per epoch


def tiny_net():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def classification_data(batch=8):
    """A learnable task (the labels are a fixed linear map's argmax), in a fixed order."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch * BATCHES, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def optimizer_and_scheduler(params):
    opt = gt.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.1 * step))


def loop_by_hand(epochs, clip=None, accumulate=1):
    """The reference: a plain loop with the same optimizer, scheduler, data and model."""
    net = tiny_net()
    opt, sched = optimizer_and_scheduler(net.parameters())
    losses = []
    for _ in range(epochs):
        for i, (x, y) in enumerate(classification_data()):
            loss = F.cross_entropy(net(x), y)
            losses.append(loss.item())
            (loss / accumulate).backward()
            if (i + 1) % accumulate:
                continue
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad()
    return net, opt, losses


def clipping_bites(epochs):
    """Whether some gradient norm of the loop exceeds CLIP (else the clipping checks prove nothing)."""
    net = tiny_net()
    opt, sched = optimizer_and_scheduler(net.parameters())
    norms = []
    for _ in range(epochs):
        for x, y in classification_data():
            F.cross_entropy(net(x), y).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
            opt.step()
            sched.step()
            opt.zero_grad()
    return max(norms) > CLIP


# -- Hugging Face Trainer ----------------------------------------------------------------------

HF_STEPS, HF_SAVE = 8, 4


# The optimizers Trainer's resume is tried with: 4-bit moments (and their DE-0 mark) go
# through Trainer's optimizer.pt as the float ones do.
HF_OPTIMIZERS = {
    "AdamW": gt.AdamW,
    "AdamW int4": lambda params, **kw: gt.AdamW(params, moments="int4", min_4bit_size=1024, **kw),
    "Lamb int4": lambda params, **kw: gt.Lamb(params, moments="int4", min_4bit_size=1024, **kw),
}


@pytest.mark.parametrize("name", HF_OPTIMIZERS)
def test_hugging_face_trainer_resumes_bit_for_bit(tmp_path, name):
    transformers = pytest.importorskip("transformers")

    def causal_lm():
        return hf_causal_lm(transformers)

    dataset = hf_tokens()

    def train(output_dir, optimizer_class=HF_OPTIMIZERS[name], max_steps=HF_STEPS, resume=None):
        model = causal_lm()
        opt = optimizer_class(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=HF_STEPS)
        args = transformers.TrainingArguments(
            output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=4,
            save_strategy="steps", save_steps=HF_SAVE, logging_steps=1, use_cpu=True, report_to="none",
            seed=0, disable_tqdm=True)  # max_grad_norm: the default, 1.0
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, optimizers=(opt, sched))
        trainer.train(resume_from_checkpoint=resume)
        return model, opt, trainer

    straight, opt, trainer = train(tmp_path / "straight")
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    assert len(norms) == HF_STEPS and max(norms) > trainer.args.max_grad_norm  # the clipping bit
    assert steps_taken(opt) == {HF_STEPS}
    if "int4" in name:  # the matrices' moments are 4-bit codes (their state carries the DE-0 mark)
        assert any("int4_second_moment_map" in s for s in opt.state_dict()["state"].values())

    train(tmp_path / "resumed", max_steps=HF_SAVE)
    checkpoint = tmp_path / "resumed" / f"checkpoint-{HF_SAVE}"
    assert (checkpoint / "optimizer.pt").is_file()
    resumed, opt, _ = train(tmp_path / "resumed", resume=str(checkpoint))
    assert steps_taken(opt) == {HF_STEPS}  # the new optimizer went on from the checkpoint's state
    assert_bitwise_equal(resumed.parameters(), straight.parameters())
    if name != "AdamW":
        return

    # The optimizer stepped the model as torch.optim.AdamW does.
    theirs, _, _ = train(tmp_path / "torch", optimizer_class=torch.optim.AdamW)
    initial = causal_lm()
    for ours, t, p0 in zip(straight.parameters(), theirs.parameters(), initial.parameters()):
        assert not torch.equal(ours, p0)
        torch.testing.assert_close(ours.detach(), t.detach(), rtol=TORCH_100_STEPS[0], atol=TORCH_100_STEPS[1])



@pytest.mark.skipif(not torch.cuda.is_available(), reason="the offloaded optimizers need a CUDA device")
def test_hugging_face_trainer_with_the_offloaded_optimizer(tmp_path):
    """Trainer clips by default (max_grad_norm=1.0) between backward and step(), after the
    offloaded optimizer's hooks have copied the gradients: that is an error naming the remedy,
    never a silent unclipped step. The remedies train as Trainer with gradkit.torch.AdamW on the
    GPU and its default clipping does: the optimizer's max_norm with max_grad_norm=0, both
    clippings at once (the gradients are copied again), and release=True."""
    transformers = pytest.importorskip("transformers")

    def train(output_dir, make_optimizer, max_grad_norm):
        model = hf_causal_lm(transformers).cuda()
        opt = make_optimizer(model.parameters())
        sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=HF_STEPS)
        args = transformers.TrainingArguments(
            output_dir=str(output_dir), max_steps=HF_STEPS, per_device_train_batch_size=4, save_strategy="no",
            report_to="none", seed=0, disable_tqdm=True, max_grad_norm=max_grad_norm)
        transformers.Trainer(model=model, args=args, train_dataset=hf_tokens(), optimizers=(opt, sched)).train()
        return model

    with pytest.raises(RuntimeError, match=r"max_norm=.*max_grad_norm=0"):
        train(tmp_path / "default", lambda p: gt.OffloadedAdamW(p, lr=LR, weight_decay=WEIGHT_DECAY), CLIP)
    reference = train(tmp_path / "gpu", lambda p: gt.AdamW(p, lr=LR, weight_decay=WEIGHT_DECAY), CLIP)
    remedies = {
        "max_norm": (dict(max_norm=CLIP), 0.0),
        "both": (dict(max_norm=CLIP), CLIP),
        "release": (dict(max_norm=CLIP, release=True), 0.0),
    }
    for name, (options, max_grad_norm) in remedies.items():
        model = train(tmp_path / name, lambda p: gt.OffloadedAdamW(p, lr=LR, weight_decay=WEIGHT_DECAY, **options),
                      max_grad_norm)
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=TORCH_100_STEPS[0],
                                       atol=TORCH_100_STEPS[1], msg=name)

# -- Lightning ---------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated")  # Lightning's own use of torch's pytree
@pytest.mark.parametrize("clip", [None, CLIP], ids=["no_clipping", "gradient_clip_val"])
def test_lightning_configure_optimizers(tmp_path, clip):
    L = pytest.importorskip("lightning")

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tiny_net()
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            opt, sched = optimizer_and_scheduler(self.parameters())
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def trainer(**limit):
        return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
                         default_root_dir=str(tmp_path), **limit)

    module = Classifier()
    fit = trainer(max_steps=2 * BATCHES)
    fit.fit(module, classification_data())
    assert isinstance(fit.optimizers[0], gt.AdamW)
    net, opt, losses = loop_by_hand(epochs=2, clip=clip)
    assert module.losses == losses
    assert sum(losses[-BATCHES:]) < sum(losses[:BATCHES])  # it learned
    assert_bitwise_equal(module.parameters(), net.parameters())
    assert steps_taken(fit.optimizers[0]) == {2 * BATCHES}
    if clip is not None:
        assert clipping_bites(epochs=2)

    # Resumed from a checkpoint made at the end of the first epoch. (A fit stopped by max_steps
    # in the middle of the data and resumed repeats a batch, with torch.optim.AdamW as well:
    # Lightning's own behaviour, which is why this stops at an epoch's end.)
    first = trainer(max_epochs=1)
    first.fit(Classifier(), classification_data())
    first.save_checkpoint(str(tmp_path / "epoch1.ckpt"))
    resumed = Classifier()
    trainer(max_epochs=2).fit(resumed, classification_data(), ckpt_path=str(tmp_path / "epoch1.ckpt"))
    assert resumed.losses == losses[BATCHES:]
    assert_bitwise_equal(resumed.parameters(), net.parameters())


# -- accelerate --------------------------------------------------------------------------------

@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps one AcceleratorState per process, and Trainer builds an Accelerator
    too: on a GPU machine the offloaded Trainer test's took the GPU, and Accelerator(cpu=True)
    then refuses to change it ("AcceleratorState has already been initialized"). A script
    has one accelerator; each test here starts from none, as accelerate's own tests do
    (AccelerateTestCase resets the state so between tests)."""
    from accelerate.state import AcceleratorState, GradientState

    def reset():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    reset()
    yield
    reset()


@pytest.mark.parametrize("accumulate", [1, 2], ids=["every_batch", "accumulate_2"])
def test_accelerate_prepare(tmp_path, accumulate, request):
    accelerate = pytest.importorskip("accelerate")
    request.getfixturevalue("fresh_accelerator_state")  # after the skip: the fixture imports accelerate

    def train(batches, save=None, load=None):
        """`batches` batches of an epoch (those before `load`'s state skipped)."""
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
        net = tiny_net()
        opt, sched = optimizer_and_scheduler(net.parameters())
        net, opt, data, sched = accelerator.prepare(net, opt, classification_data(), sched)
        assert opt.optimizer.__class__ is gt.AdamW
        start = 0
        if load is not None:
            accelerator.load_state(str(load))
            start = batches // 2
            data = accelerator.skip_first_batches(data, start)
        losses = []
        for i, (x, y) in enumerate(data, start):
            if i == batches:
                break
            with accelerator.accumulate(net):
                loss = F.cross_entropy(net(x), y)
                losses.append(loss.item())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(net.parameters(), CLIP)
                opt.step()
                sched.step()
                opt.zero_grad()
        if save is not None:
            accelerator.save_state(str(save))
        return net, opt.optimizer, losses

    prepared, opt, losses = train(BATCHES)
    net, _, by_hand = loop_by_hand(epochs=1, clip=CLIP, accumulate=accumulate)
    assert losses == by_hand
    assert_bitwise_equal(prepared.parameters(), net.parameters())
    assert not any(torch.equal(p, p0) for p, p0 in zip(prepared.parameters(), tiny_net().parameters()))
    assert steps_taken(opt) == {BATCHES // accumulate}
    assert clipping_bites(epochs=1)

    # save_state after half the batches, load_state into a new model and optimizer, go on.
    train(BATCHES // 2, save=tmp_path / "state")
    resumed, opt, rest = train(BATCHES, load=tmp_path / "state")
    assert rest == by_hand[BATCHES // 2:]
    assert steps_taken(opt) == {BATCHES // accumulate}
    assert_bitwise_equal(resumed.parameters(), net.parameters())
