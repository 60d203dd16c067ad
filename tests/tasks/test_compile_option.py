"""The tasks' ``compile`` option: checkpoints are the same with and without it, a run trained compiled
continues uncompiled (and the other way round), and a failure names what failed.

Compiled here with the ``aot_eager`` backend (``compile: {backend: aot_eager}``): the same graphs
as Inductor's input, without generating code, so the tests stay cheap. The micro ViT comes from
``tests/models/test_vit.py`` (``micro_vit``).
"""

from __future__ import annotations

import pytest
import torch

from mmlight.data import DigitsDataModule, write_digits_shards
from mmlight.models import ReweightingSpec
from mmlight.nn.attention import record_attention
from mmlight.tasks import ImageClassifier
from mmlight.tasks.compiling import compile_kwargs
from tests.helpers.models import micro_vit
from tests.helpers.trainer import quiet_trainer

MICRO = micro_vit(attention=ReweightingSpec("multimax"), output_multimax=True, drop_path_rate=0.0)
COMPILED = {"backend": "aot_eager"}

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    write_digits_shards(root)
    return root


def fit(module, digits, steps, ckpt_path=None, **trainer):
    torch.manual_seed(0)
    run = quiet_trainer(max_steps=steps, limit_val_batches=1, gradient_clip_val=1.0, **trainer)
    run.fit(module, DigitsDataModule(cache_dir=str(digits), batch_size=16), ckpt_path=ckpt_path)
    return run


def test_compile_kwargs():
    assert compile_kwargs(False) is None
    assert compile_kwargs(True) == {"fullgraph": True}
    assert compile_kwargs({"mode": "max-autotune"}) == {"fullgraph": True, "mode": "max-autotune"}
    assert compile_kwargs({"fullgraph": False}) == {"fullgraph": False}
    with pytest.raises(ValueError, match=r"unknown torch.compile option\(s\) \['modes'\]"):
        compile_kwargs({"modes": "max-autotune"})
    # the network is torch.compile's first argument, never an option; the message lists what is accepted
    with pytest.raises(ValueError) as refused:
        compile_kwargs({"model": None})
    assert str(refused.value).startswith("compile: unknown torch.compile option(s) ['model']; it accepts [")
    assert "'mode'" in str(refused.value) and "'model'" not in str(refused.value).split("accepts")[1]
    with pytest.raises(TypeError, match="compile must be true, false or a dict"):
        compile_kwargs("yes")


def test_trained_compiled_continues_uncompiled_and_back_with_the_same_weights(digits, tmp_path):
    torch.manual_seed(0)
    compiled = ImageClassifier(MICRO, ema_decay=0.9, compile=COMPILED, lr_reference_batch=None)
    run = fit(compiled, digits, 3)
    path = tmp_path / "compiled.ckpt"
    run.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert not [k for k in state if "_orig_mod" in k]
    torch.manual_seed(0)  # the same initial weights
    eager = ImageClassifier(MICRO, ema_decay=0.9, lr_reference_batch=None)
    assert state.keys() == eager.state_dict().keys()
    # the same three steps uncompiled reach the same weights, EMA included (aot_eager runs the same
    # kernels; a gradient's contributions may be summed in another order: a few ulps, amplified by
    # three Adam steps on parameters near zero)
    fit(eager, digits, 3)
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")

    # resumed uncompiled (the option from the command line: a keyword over the checkpoint's) ...
    resumed = ImageClassifier.load_from_checkpoint(path, compile=False)
    assert resumed.compiled.kwargs is None
    run = fit(resumed, digits, 5, ckpt_path=path)
    assert run.global_step == 5
    validated = quiet_trainer(limit_val_batches=1).validate(
        resumed, DigitsDataModule(cache_dir=str(digits), batch_size=16)
    )
    # their values compiled and not: test_compiled_evaluation_of_the_ema_weights_equals_the_uncompiled_one
    assert {"val/top1", "val/ema_top1"} <= validated[0].keys()
    # ... and an uncompiled checkpoint resumes compiled, in bf16-mixed
    path2 = tmp_path / "eager.ckpt"
    run.save_checkpoint(path2)
    again = ImageClassifier.load_from_checkpoint(path2, compile=COMPILED)
    assert fit(again, digits, 7, ckpt_path=path2, precision="bf16-mixed").global_step == 7


def test_a_compile_failure_names_the_method_and_the_functions(digits):
    module = ImageClassifier(MICRO, compile={"backend": "no_such_backend"})
    # the sanity check's evaluation forward is the first compiled call
    message = (
        r"torch.compile of ReweightedViT.forward \(reweighting: MultiMax \(backend auto\)\) failed: Invalid backend"
    )
    with pytest.raises(RuntimeError, match=message):
        fit(module, digits, 1)


def test_compiled_evaluation_of_the_ema_weights_equals_the_uncompiled_one(digits):
    """The EMA network evaluated compiled gives the uncompiled ``val/ema_top1`` and the value recomputed by hand.
    The EMA's head answers class 3 for every image and the network's class 5, so each accuracy is the share
    of that class among the labels: a compiled call that ran the network in place of its EMA would show."""
    torch.manual_seed(0)
    module = ImageClassifier(micro_vit(drop_path_rate=0.0), ema_decay=0.9, compile=COMPILED)
    with torch.no_grad():
        for network, answer in ((module.ema.module, 3), (module.model, 5)):
            network.vit.head.weight.zero_()
            network.vit.head.bias.copy_(torch.nn.functional.one_hot(torch.tensor(answer), 10).float())
    data = DigitsDataModule(cache_dir=str(digits), batch_size=16)
    compiled = quiet_trainer(limit_val_batches=2).validate(module, data, verbose=False)[0]
    assert len(module.compiled._compiled) == 2  # the network's forward and the EMA's, each compiled
    module.compiled = type(module.compiled)(False, module.model)  # the same weights, uncompiled
    eager = quiet_trainer(limit_val_batches=2).validate(module, data, verbose=False)[0]
    data.setup("validate")
    labels = torch.cat([labels for _, (_, labels) in zip(range(2), data.val_dataloader())])
    share = {c: (labels == c).float().mean().item() for c in (3, 5)}
    assert len(labels) == 32 and share[3] != share[5]
    assert compiled["val/ema_top1"] == eager["val/ema_top1"] == pytest.approx(share[3], abs=1e-6)
    assert compiled["val/top1"] == eager["val/top1"] == pytest.approx(share[5], abs=1e-6)


def test_compile_off_never_calls_torch_compile(digits, monkeypatch):
    """``compile: false`` (the default): a fit with validation and an EMA runs without torch.compile."""
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("torch.compile called with compile off"))
    module = ImageClassifier(micro_vit(drop_path_rate=0.0), ema_decay=0.9, lr_reference_batch=None)
    assert module.compiled.kwargs is None
    assert fit(module, digits, 2).global_step == 2 and module.compiled._compiled == {}


def test_describe_names_each_kind_of_reweighting_once_and_a_copy_compiles_anew():
    """``describe`` (the text a compile failure quotes) lists each function and backend once, sorted; a copy
    (the EMA network's deepcopy, a pickle) starts with no compiled callables and keeps the option."""
    import copy
    import pickle
    from types import SimpleNamespace

    from mmlight.reweighting import MultiMax, Softmax
    from mmlight.tasks.compiling import CompiledCalls

    sites = {"a": MultiMax(backend="reference"), "b": Softmax(), "c": MultiMax(backend="reference")}
    calls = CompiledCalls(COMPILED, SimpleNamespace(reweighting_sites=lambda: sites))
    assert calls.describe() == "reweighting: MultiMax (backend reference), Softmax (backend auto)"
    plain = CompiledCalls(COMPILED, torch.nn.Linear(2, 2))  # picklable, as a checkpointed task's is
    for original in (calls, plain):
        original._compiled[(1, "forward")] = print  # what a first call leaves; a copy must not share it
    for copied in (copy.deepcopy(calls), pickle.loads(pickle.dumps(plain))):
        assert set(vars(copied)) == {"kwargs", "network", "_compiled"} and copied._compiled == {}
        assert copied.kwargs == {"fullgraph": True, "backend": "aot_eager"}
    assert calls._compiled == plain._compiled == {(1, "forward"): print}


@pytest.mark.parametrize(
    "message, first",
    [("Unsupported: guard on shape X.\nfrom user code: ...", "Unsupported: guard on shape X"), ("  ", None)],
    ids=["first_line", "empty"],
)
def test_a_compile_failure_quotes_the_first_line_of_dynamos_error(monkeypatch, message, first):
    """The error: the method, the functions, Dynamo's first line without its full stop (its class name when it
    has no message), and Dynamo's error as the cause."""
    from types import SimpleNamespace

    from torch._dynamo.exc import TorchDynamoException

    from mmlight.reweighting import Softmax
    from mmlight.tasks.compiling import CompiledCalls

    error = TorchDynamoException(message)

    def failing(*args, **kwargs):
        raise error

    calls = CompiledCalls(COMPILED, SimpleNamespace(reweighting_sites=lambda: {"a": Softmax()}))
    monkeypatch.setattr(torch, "compile", lambda method, **kwargs: failing)  # after the options are checked
    network = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError) as raised:
        calls(network.forward, torch.zeros(1, 2))
    assert str(raised.value) == (
        f"torch.compile of Linear.forward (reweighting: Softmax (backend auto)) failed: "
        f"{first or 'TorchDynamoException'}. The cause below names the function and line; set compile: false to "
        "run uncompiled."
    )
    assert raised.value.__cause__ is error


def test_a_compiled_network_runs_eagerly_while_its_attention_is_recorded(monkeypatch):
    """Observers (the analysis hooks) see every weight only on the eager path: inside ``record_attention``
    the compiled call is not made, and the weights of each site are recorded; outside, it is."""
    compiled_calls = []

    def fake_compile(fn, **kwargs):
        return lambda *args, **kw: compiled_calls.append(kwargs) or fn(*args, **kw)

    module = ImageClassifier(MICRO, compile=COMPILED, lr_reference_batch=None).eval()
    monkeypatch.setattr(torch, "compile", fake_compile)
    images = torch.randn(2, 1, 8, 8)
    with record_attention(module.model) as recorder:
        inside = module.compiled(module.model.forward, images)
    assert compiled_calls == [] and sorted(recorder.sites()) == sorted(module.model.attention_sites())
    outside = module.compiled(module.model.forward, images)
    assert compiled_calls == [{"fullgraph": True, **COMPILED}]
    torch.testing.assert_close(inside, outside)


@pytest.mark.parametrize("task", ["lm", "translator"])
def test_the_sequence_tasks_compile_their_training_loss_and_describe_their_network(task, monkeypatch):
    """With ``compile`` on, the LM's and the translator's training step run the network's ``loss`` through
    torch.compile with the option's arguments (and give the eager loss), and a failure would name the
    network's functions; with it off nothing is compiled."""
    from mmlight.tasks import LanguageModel, Translator
    from tests.helpers.models import PAD, tiny_transformer

    compiled = []

    def fake_compile(method, **kwargs):
        compiled.append((method.__name__, kwargs))
        return method

    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(2, 20, (2, 5), generator=g), torch.randint(2, 20, (2, 5), generator=g)
    targets[1, 3:] = PAD
    if task == "lm":
        batch = {"input": tokens, "target": targets, "loss_mask": torch.ones(2, 5, dtype=torch.bool)}
        build = lambda option: LanguageModel(tiny_transformer(dropout=0.0), compile=option)  # noqa: E731
    else:
        src = torch.randint(2, 20, (2, 4), generator=g)
        batch = {"src": src, "tgt_in": tokens, "tgt_out": targets, "src_mask": src != PAD, "tgt_mask": targets != PAD}
        config = tiny_transformer(dropout=0.0, n_encoder_layers=1)
        build = lambda option: Translator(config, compile=option)  # noqa: E731
    losses = []
    for option in (COMPILED, False):
        torch.manual_seed(0)
        module = build(option)
        monkeypatch.setattr(torch, "compile", fake_compile)  # after the task checked the option against it
        module.log = lambda *args, **kwargs: None
        losses.append(module.training_step(batch, 0))
        assert module.compiled.describe() == "reweighting: Softmax (backend auto)"
    assert compiled == [("loss", {"fullgraph": True, "backend": "aot_eager"})]  # the compiled run's only
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


def test_the_classifier_compiles_its_training_loss(monkeypatch):
    """Without mixup the image classifier's training step runs the network's ``loss`` compiled."""
    compiled = []

    def fake_compile(method, **kwargs):
        compiled.append((method.__name__, kwargs))
        return method

    module = ImageClassifier(MICRO, compile=COMPILED, lr_reference_batch=None)
    monkeypatch.setattr(torch, "compile", fake_compile)  # after the task checked the option against it
    module.log = lambda *args, **kwargs: None
    loss = module.training_step((torch.randn(2, 1, 8, 8), torch.tensor([1, 3])), 0)
    assert compiled == [("loss", {"fullgraph": True, "backend": "aot_eager"})] and torch.isfinite(loss)
