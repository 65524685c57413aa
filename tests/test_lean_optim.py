"""Memory-lean training: frozen parameters cost nothing on a grid, and every method in
train/methods trains on a grid as on one process (see lean_worker.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from fourfold.methods import method_options, method_spec
from grid_cases import launch_grid_cases

WORKER = Path(__file__).with_name("lean_worker.py")


class Refuse:
    """A StepGuard (train/methods/base.py) that rejects every step."""

    def check(self, loss: float, grad_norm: float) -> str:
        return "skipped"

    def allow(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), dtype=torch.bool, device=loss.device)


def run_worker(nproc: int, grids: list, checks: list, tmp_path: Path) -> list[dict]:
    """Every rank's result of every (grid, check): see grid_cases.launch_grid_cases."""
    return launch_grid_cases(WORKER, nproc, grids, "FOURFOLD_TEST_CHECKS", "check", checks,
                             tmp_path / f"lean_{nproc}.jsonl", timeout=900)


def check_frozen(r: dict) -> None:
    label = f"grid {r['shape']} rank {r['rank']} frozen"
    assert r["frozen_with_grad"] == [], label
    assert r["unchanged"], label
    assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["ref_losses"])) < 1e-5, label
    assert r["max_weight_diff"] < 1e-5, label
    assert r["ledger_delta"] == r["expected_delta"], label
    full, frozen = r["saved_bytes"]
    assert frozen < full, f"{label}: saved {frozen} bytes frozen vs {full}"


@pytest.mark.ranks
def test_frozen_parameters_cost_nothing_on_grids(tmp_path: Path) -> None:
    grids = [[1, 2, 1, 1], [2, 1, 1, 1], [1, 1, 2, 1], [1, 1, 1, 2]]
    for r in run_worker(2, grids, [{"name": "frozen"}], tmp_path):
        check_frozen(r)


MEZO = {"name": "mezo", "steps": 20, "accum": 2, "train": {"lr": 1e-3}, "method": {"eps": 1e-3}}
ES = {"name": "es", "steps": 20, "freeze": True,
      "train": {"lr": 1e-3}, "method": {"sigma": 1e-3, "population": 4}}
# OpenAI-ES: mirrored pairs, centered ranks (whose steps are larger than the baseline's: a
# smaller lr)
OPENAI_ES = {"name": "es", "steps": 20, "freeze": True, "train": {"lr": 1e-5},
             "method": {"sigma": 1e-3, "population": 4, "antithetic": True,
                        "fitness": "centered_rank"}}


def check_trains_as_one_process(r: dict) -> None:
    label = f"grid {r['shape']} rank {r['rank']} {r['check']['name']}"
    assert r["max_rel_loss"] < 1e-5, f"{label}: losses {r['losses']} vs {r['ref_losses']}"
    assert r["max_weight_diff"] < 1e-5 * max(1.0, r["weight_change"] * 100), \
        f"{label}: weights differ by {r['max_weight_diff']} (moved {r['weight_change']})"
    # the worker's batches alternate between two kinds, so compare a pair with a pair
    first, last = sum(r["ref_losses"][:2]), sum(r["ref_losses"][-2:])
    assert last < first, f"{label}: did not learn {r['ref_losses']}"


@pytest.mark.ranks
def test_zeroth_order_methods_train_as_one_process(tmp_path: Path) -> None:
    grids = [[1, 2, 1, 1], [2, 1, 1, 1], [1, 1, 2, 1], [1, 1, 1, 2]]
    for r in run_worker(2, grids, [MEZO, ES, OPENAI_ES], tmp_path):
        check_trains_as_one_process(r)
        data, z, y, x = r["shape"]
        label = f"grid {r['shape']} rank {r['rank']} {r['check']['name']}"
        assert r["state_bytes"] == 0, label  # no optimizer state: a step count only
        # the batch axes carry scalars only: per step, MeZO's two losses; ES's population
        per_step = 2 * 8 if r["check"]["name"] == "mezo" else 4 * 8
        steps = r["check"]["steps"]
        assert r["ledger"]["data"] == 0, label
        # z carries the forward's weight all-gathers and nothing else (no gradient)
        forwards = steps * (2 * r["check"].get("accum", 1) if r["check"]["name"] == "mezo"
                            else 4 // data)
        assert r["ledger"]["z"] == forwards * r["forward_gather_bytes"], f"{label}: {r['ledger']}"
        if data * z > 1 or x * y > 1:
            assert r["ledger"]["all"] == steps * per_step, f"{label}: {r['ledger']}"


# ---- one process -----------------------------------------------------------------------------


def test_noise_of_a_shard_is_its_part_of_the_full_tensors_noise() -> None:
    import random

    from fourfold.noise import ShardNoise, mix32, mix32_int, noise_key

    values = [random.Random(3).getrandbits(32) for _ in range(500)] + [0, 1, 2**31, 2**32 - 1]
    as_int32 = torch.tensor([v - 2**32 if v >= 2**31 else v for v in values], dtype=torch.int32)
    assert [h & 0xFFFFFFFF for h in mix32(as_int32).tolist()] == [mix32_int(v) for v in values]
    key = noise_key(1337, 5, "layers.0.attn.q_proj.weight")
    assert key != noise_key(1337, 6, "layers.0.attn.q_proj.weight")
    assert key != noise_key(1337, 5, "layers.0.attn.k_proj.weight")
    cpu = torch.device("cpu")
    full = ShardNoise((64, 48), (64, 48), (0, 0), cpu).sample(0, 64, key)
    shard = ShardNoise((16, 24), (64, 48), (32, 24), cpu)
    shard.rows_per_chunk = 5  # made in row blocks, as big tensors are
    parts = torch.cat([shard.sample(a, b, key) for a, b in shard.chunks()])
    assert torch.equal(parts, full[32:48, 24:48])
    assert abs(float(full.mean())) < 0.1 and abs(float(full.std()) - 1) < 0.05
    # a GPU makes bigger chunks (launches, not bytes, cost there): the same values
    from fourfold.noise import chunk_elements

    assert chunk_elements(torch.device("cuda")) > chunk_elements(cpu)


def test_optimizer_keys_are_checked() -> None:
    from fourfold.config import ConfigError, load_config

    mezo = load_config(None, ["train.optimizer=mezo", "train.method.eps=0.01"])
    assert mezo.train.options().eps == 0.01
    bad = {("train.optimizer=sgd",): "train.optimizer = 'sgd': choose one of adamw",
           ("train.method.sigma=0.1",): "train.method.sigma applies only to train.optimizer = "
                                        "'es', not 'adamw'",
           ("train.optimizer=es", "train.method.population=1"): "train.method.population = 1",
           ("train.optimizer=es", "train.method.antithetic=true", "train.method.population=5"):
               "train.method.population = 5: must be even with train.method.antithetic = true",
           ("train.optimizer=es", "train.method.fitness=rank"):
               "train.method.fitness = 'rank': choose one of baseline, centered_rank, "
               "zscore",
           ("train.optimizer=mezo", "train.method.eps=0"): "train.method.eps = 0.0: must be a "
                                                           "positive number",
           ("train.optimizer=mezo", "train.method.epss=1"): "unknown key train.method.epss "
                                                            "(did you mean 'eps'?)",
           ("train.method.clip_mode=value",): "train.method.clip_mode applies only to",
           ("train.optimizer=blockllm", "train.method.sparsity=1"): "train.method.sparsity = "
                                                                    "1.0",
           ("train.optimizer=galore", "train.method.gap=0"): "train.method.gap = 0: must be",
           ("train.optimizer=galore", "train.method.rank=-2"): "train.method.rank = -2",
           ("train.optimizer=galore", "train.method.rank=x"): "train.method.rank = 'x': "
                                                              "expected an integer",
           ("train.optimizer=galore", "adapter.kind=norm"): "cannot train a subset",
           ("train.optimizer=galore", "train.method.targets=q,lm_head"):
               "train.method.targets: 'lm_head' is not a matrix of the model; choose from q",
           ("train.optimizer=galore", "train.method.proj_type=side"):
               "train.method.proj_type = 'side': choose one of std, reverse_std",
           ("train.optimizer=blockllm", "train.method.block_unit=column"):
               "train.method.block_unit = 'column': choose one of tensor, row",
           ("train.optimizer=blockllm", "train.method.reselect=never"):
               "train.method.reselect = 'never': choose one of average, best",
           ("train.optimizer=adalomo", "train.method.decay_rate=0.8"):
               "train.method.decay_rate = 0.8: must be negative",
           ("train.optimizer=adalomo", "train.method.clip_threshold=0"):
               "train.method.clip_threshold = 0.0: must be a positive number",
           ("train.weight_decay=heavy",): 'train.weight_decay = \'heavy\': expected a number or '
                                          '"auto"',
           ("train.optimizer=lomo", "train.weight_decay=-0.1"): "train.weight_decay = -0.1: "
                                                                "must not be negative"}
    for items, message in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, list(items))


def test_old_method_keys_are_read_with_a_notice() -> None:
    """The options' keys before [train.method] (train.galore_gap, train.es_sigma, ...) still
    work, each with one line naming its new key; one of another method is refused as before
    unless it holds that method's default; both the old and the new key set is refused."""
    from fourfold.config import ConfigError, load_config
    from fourfold.errors import ConfigNotice

    for items, option, value in (
            (["train.optimizer=galore", "train.galore_gap=7"], "gap", 7),
            (["train.optimizer=galore", "train.galore_rank=4"], "rank", 4),
            (["train.optimizer=es", "train.es_population=4"], "population", 4),
            (["train.optimizer=es", "train.es_sigma=0.01"], "sigma", 0.01),
            (["train.optimizer=mezo", "train.mezo_eps=0.01"], "eps", 0.01),
            (["train.optimizer=blockllm", "train.block_sparsity=0.5"], "sparsity", 0.5),
            (["train.optimizer=blockllm", "train.block_patience=3"], "patience", 3),
            (["train.optimizer=adalomo", "train.clip_mode=value"], "clip_mode", "value")):
        with pytest.warns(ConfigNotice) as notes:
            cfg = load_config(None, items)
        assert getattr(cfg.train.options(), option) == value
        old = items[1].split("=")[0]
        assert [str(n.message) for n in notes] == [
            f"{old} is deprecated: write train.method.{option} (the [train.method] section)"]
    with pytest.raises(ConfigError, match="train.galore_gap = 7 applies only to "
                                          "train.optimizer = 'galore', not 'lomo'"):
        load_config(None, ["train.optimizer=lomo", "train.galore_gap=7"])
    with pytest.raises(ConfigError, match="train.clip_mode = 'value' applies only to "
                                          "train.optimizer = 'lomo' or 'adalomo', not 'adamw'"):
        load_config(None, ["train.clip_mode=value"])
    with pytest.warns(ConfigNotice, match="write train.method.gap under train.optimizer = "
                                          "'galore'"):
        load_config(None, ["train.galore_gap=200"])  # another method's, at its default
    with pytest.raises(ConfigError, match="train.galore_gap and train.method.gap are both set"):
        load_config(None, ["train.optimizer=galore", "train.galore_gap=3", "train.method.gap=4"])


def test_method_options_section_round_trips(tmp_path: Path) -> None:
    """[train.method] in a file, in the run's config.toml and back; the old [train] keys of a
    config.toml an older version wrote are read silently."""
    import warnings

    from fourfold.config import load_config

    path = tmp_path / "galore.toml"
    path.write_text('[train]\noptimizer = "galore"\n[train.method]\nrank = 8\n')
    cfg = load_config(path, ["train.method.gap=9"])
    assert (cfg.train.options().rank, cfg.train.options().gap) == (8, 9)
    cfg.save(tmp_path / "config.toml")
    assert "[train.method]\nrank = 8\ngap = 9\n" in (tmp_path / "config.toml").read_text()
    assert load_config(tmp_path / "config.toml", saved=True).train.options() == cfg.train.options()
    (tmp_path / "old.toml").write_text('[train]\noptimizer = "galore"\ngalore_gap = 5\n'
                                       'es_sigma = 0.001\nclip_mode = "none"\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(tmp_path / "old.toml", saved=True).train.options().gap == 5


def test_weight_decay_auto_follows_the_optimizer(tmp_path: Path) -> None:
    """weight_decay = "auto" (the default) is each method's paper's: AdamW's 0.1, none for
    GaLore and BlockLLM (their papers' runs and code) and the methods without an Adam step;
    a number given is used as it is, and a run's
    config.toml keeps "auto" (a run of it repeats the run)."""
    from fourfold.config import load_config

    for optimizer, decay in (("adamw", 0.1), ("blockllm", 0.0), ("galore", 0.0), ("lomo", 0.0),
                             ("adalomo", 0.0), ("mezo", 0.0), ("es", 0.0)):
        cfg = load_config(None, [f"train.optimizer={optimizer}"])
        assert cfg.train.weight_decay == "auto"
        assert cfg.train.effective_weight_decay() == decay, optimizer
        given = load_config(None, [f"train.optimizer={optimizer}", "train.weight_decay=0.05"])
        assert given.train.effective_weight_decay() == 0.05, optimizer
    cfg = load_config(None, ["train.optimizer=lomo"])
    cfg.save(tmp_path / "config.toml")
    assert load_config(tmp_path / "config.toml", saved=True).train.weight_decay == "auto"


def test_saved_run_config_reads_after_a_default_changes(tmp_path: Path) -> None:
    """A run's config.toml records every key, other optimizers' options at the defaults of the
    version that wrote it (block_patience was 10): read back as a RUN_DIR they are dropped,
    given as a user's config they are still refused."""
    from fourfold.config import ConfigError, load_config
    from fourfold.train.runs import run_config

    (tmp_path / "config.toml").write_text('[train]\noptimizer = "adamw"\nblock_patience = 10\n'
                                          'block_sparsity = 0.9\n')
    assert run_config(tmp_path).train.optimizer == "adamw"
    with pytest.raises(ConfigError, match="train.block_patience = 10 applies only to"):
        load_config(tmp_path / "config.toml")
    (tmp_path / "config.toml").write_text('[train]\noptimizer = "blockllm"\n'
                                          'block_patience = 10\n')
    assert run_config(tmp_path).train.options().patience == 10  # its own option: kept


def test_build_optimizer_builds_adamw_only() -> None:
    from fourfold.config import ConfigError, TrainConfig, model_config
    from fourfold.models import build_model
    from fourfold.train.optim import build_optimizer

    model = build_model(model_config("debug"), seed=0)
    with pytest.raises(ConfigError, match="train.optimizer = 'mezo': build_optimizer builds AdamW"):
        build_optimizer(model.named_parameters(), TrainConfig(optimizer="mezo"))


def test_frozen_parameters_have_no_optimizer_state() -> None:
    from fourfold.config import TrainConfig, model_config
    from fourfold.models import build_model
    from fourfold.parallel import Grid, parallelize
    from fourfold.train.methods import StepData, build_method

    model = build_model(model_config("debug"), seed=0)
    for name, p in model.named_parameters():
        p.requires_grad_(".ffn." in name)
    pmodel = parallelize(model, Grid.single())
    method = build_method(pmodel, TrainConfig(optimizer="adamw"))
    tokens = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    data = StepData.one_batch(pmodel, tokens)
    method.step(pmodel, data, lr=1e-3)
    tensors, meta = method.state_dict()
    assert tensors and all(".ffn." in key for key in tensors)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert method.state_bytes() == 2 * trainable  # two moments, trainable parameters only
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["mezo", "es", "adalomo", "adamw", "blockllm", "galore"])
def test_state_dict_resumes_exactly(optimizer: str) -> None:
    from fourfold.config import TrainConfig, model_config
    from fourfold.models import build_model
    from fourfold.parallel import Grid, parallelize
    from fourfold.train.methods import StepData, build_method

    # blockllm reselects and galore refreshes its projection across the resume
    extra = {"es": {"population": 4},
             "blockllm": {"sparsity": 0.5, "patience": 1, "reselect": "best"},
             "galore": {"gap": 3}}.get(optimizer, {})
    cfg = TrainConfig(optimizer=optimizer, lr=1e-3, method=method_options(optimizer, **extra))
    tokens = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))

    def run(steps: int, resume_from: tuple | None = None, weights=None):
        model = build_model(model_config("debug", dim=64, n_heads=4, n_kv_heads=2,
                                         ffn_dim=128), seed=0)
        if weights is not None:
            model.load_state_dict(weights)
        pmodel = parallelize(model, Grid.single())
        method = build_method(pmodel, cfg)
        if resume_from is not None:
            method.load_state_dict(*resume_from)
        data = StepData.one_batch(pmodel, tokens)
        losses = [method.step(pmodel, data, cfg.lr).loss for _ in range(steps)]
        return losses, method.state_dict(), model.state_dict()

    straight, _, _ = run(4)
    first, (tensors, meta), weights = run(2)
    json.loads(json.dumps(meta))  # JSON, nothing pickled
    second, _, _ = run(2, resume_from=(tensors, meta), weights=weights)
    assert meta["kind"] == optimizer
    if optimizer in ("mezo", "es"):  # the noise of a step is keyed by the step count
        assert meta["steps_done"] == 2 and tensors == {}
    else:
        assert tensors
    assert first + second == straight


LOMO_CHECKS = [{"name": "lomo", "steps": 20, "train": {"lr": 0.1, "grad_clip": 0.5},
                "method": {"clip_mode": "two_pass"}},
               {"name": "lomo", "steps": 20, "freeze": True,
                "train": {"lr": 0.1, "grad_clip": 0.002}, "method": {"clip_mode": "value"}}]


ADALOMO_CHECKS = [{"name": "adalomo", "steps": 20, "train": {"lr": 1e-2}},
                  {"name": "adalomo", "steps": 20, "freeze": True,
                   "train": {"lr": 1e-2, "grad_clip": 0.05}, "method": {"clip_mode": "two_pass"}}]


# patience 1: the alternating batches make every other step a reselection. The key bias has
# no gradient but rounding noise (softmax ignores it), which an Adam step turns into +-lr
# whatever the noise's size: it stays frozen, as its grid-vs-one-process noise is no test
# BlockLLM as fourfold first made it (rows as blocks, the best-loss rule, moments kept, the
# first choice by gradient, every parameter a candidate, no visit penalty): the tests of its
# streamed row choice
ROW_BLOCKS = {"block_unit": "row", "reselect": "best", "keep_moments": True,
              "first_choice": "gradient", "train_embed_output": True, "visit_penalty": False}
SUBSET_LR = 3e-3
BLOCKLLM = {"name": "blockllm", "steps": 20, "freeze": ["k_proj.bias"],
            "train": {"lr": SUBSET_LR},
            "method": {"sparsity": 0.8, "patience": 1, **ROW_BLOCKS}}
# every matrix projected, the embedding and output layer too: their shards are the largest
GALORE = {"name": "galore", "steps": 20, "freeze": ["k_proj.bias"],
          "train": {"lr": SUBSET_LR},
          "method": {"gap": 5, "targets": ["q", "k", "v", "o", "gate", "up", "down", "output",
                                           "embed"]}}


def check_subset_method(r: dict) -> None:
    """BlockLLM and GaLore: losses as one process, less optimizer state than AdamW's.

    Weights: both run Adam, which divides tiny gradients by their own size and so turns float
    rounding into visible weight noise (test_parallel compares AdamW by its losses only);
    BlockLLM restarts Adam on each newly selected block, so its weights are not compared;
    GaLore's stay within a fifth of one step (lr)."""
    label = f"grid {r['shape']} rank {r['rank']} {r['check']['name']}"
    assert r["max_rel_loss"] < 1e-5, f"{label}: losses {r['losses']} vs {r['ref_losses']}"
    first, last = sum(r["ref_losses"][:2]), sum(r["ref_losses"][-2:])
    assert last < first, f"{label}: did not learn {r['ref_losses']}"
    assert r["grads_left"] == [], label
    adamw_state = 2 * r["param_bytes"]
    if r["check"]["name"] == "blockllm":
        assert r["meta"]["reselections"] >= 5, f"{label}: {r['meta']}"
        # moments and a step count for each selected row this rank holds (20% of the
        # elements; a little more of a rank's shards, which hold replicated vectors whole)
        assert r["state_bytes"] == 8 * r["selected_local"][0] + 4 * r["selected_local"][1], label
        assert 0 < r["state_bytes"] <= 0.25 * adamw_state, label
        # a tensor with a chosen row reduces its whole shard gradient, one with none nothing:
        # never more than every gradient every step
        if r["shape"][0] > 1:
            every = r["check"]["steps"] * r["param_bytes"]
            assert 0 < r["ledger"]["data"] <= every, f"{label}: {r['ledger']} vs {every}"
        check_blockllm_selection(r, label)
        check_own_collectives(r, label)
    else:  # rank-16 moments of 64-wide matrices, plus the projections
        assert r["max_weight_diff"] < 0.2 * SUBSET_LR, f"{label}: {r['max_weight_diff']}"
        assert 0 < r["state_bytes"] < 0.6 * adamw_state, label
        check_galore_refreshes(r, label)
        check_own_collectives(r, label)


def check_own_collectives(r: dict, label: str) -> None:
    """A method's own collectives in a step (GaLore's and a BlockLLM selection's ledger less an
    AdamW step's, AdaLomo's less a LOMO step's; lean_worker.own_collectives): what the
    planner's step time charges it (plan/perf.py method_collectives), bytes and calls per axis;
    GaLore's refresh step less the step before it: plan/perf.py galore_refresh_collectives."""
    own = r["own_collectives"]
    assert own["measured"] == own["predicted"], f"{label}: {own}"
    assert own["measured_calls"] == own["predicted_calls"], f"{label}: {own}"
    assert (sum(own["measured"].values()) > 0) == (math.prod(r["shape"][1:]) > 1), label
    if r["check"]["name"] == "galore":  # and a refresh's, beyond its other steps'
        refresh = own["refresh"]
        assert refresh["measured"] == refresh["predicted"], f"{label}: {refresh}"
        assert refresh["measured_calls"] == refresh["predicted_calls"], f"{label}: {refresh}"
        assert (sum(refresh["measured"].values()) > 0) == (math.prod(r["shape"][1:]) > 1), label


def check_galore_refreshes(r: dict, label: str) -> None:
    """GaLore's Gram refresh on a grid (lean_worker.galore_refreshes): the basis one process
    computes, the SVD's subspace; a rank moves its shard's columns (rows) gathered over the
    small side's axes (at most twice with two of them) and the Gram's lower triangle (float64)
    over each of the long side's."""
    assert len(r["refreshes"]) >= 8, label
    for f in r["refreshes"]:
        where = f"{label} {f['name']}"
        assert f["vs_one"] < 1e-5 and f["vs_svd"] < 1e-5, f"{where}: {f}"
        s = f["small"]
        gram = 4 * s * (s + 1) * f["long_axes"]  # over each axis in turn
        gather = 2 * f["small_parts"] * f["shard_bytes"] if f["small_parts"] > 1 else 0
        assert f["moved"] <= gather + gram, f"{where}: {f}"
        assert (f["moved"] > 0) == (f["small_parts"] * f["long_parts"] > 1), f"{where}: {f}"


def check_blockllm_selection(r: dict, label: str) -> None:
    """The streamed selection (row norms taken at each hand-off, gradients freed but for the
    rows still in the choice) against the selection by one backward that holds every gradient
    (lean_worker.full_backward_blockllm), on this grid and on one process: the same norms, the
    same rows, the same losses. And fewer gradients alive at once."""
    def chosen(key: str) -> list:
        return [s["selected"] for s in r[key]]

    def close(a: list, b: list, rel: float) -> bool:
        return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))

    assert len(r["selections"]) == r["meta"]["reselections"] + 1, label
    assert chosen("selections") == chosen("full_selections"), label
    assert chosen("ref_selections") == chosen("full_ref_selections"), label
    # rows, not whole tensors: some tensor is chosen in part
    assert any(len(rows) < r["rows"][name] for s in r["selections"]
               for name, rows in s["selected"].items()), label
    for new, full in [("selections", "full_selections"), ("ref_selections", "full_ref_selections")]:
        for a, b in zip(r[new], r[full]):
            assert a["norms"].keys() == b["norms"].keys(), label
            for name in b["norms"]:
                assert close(a["norms"][name], b["norms"][name], 1e-12), f"{label} {new} {name}"
    assert close(r["losses"], r["full_losses"], 1e-12), label
    assert close(r["ref_losses"], r["full_ref_losses"], 1e-12), label
    # the full-backward selection holds every gradient; the streamed one the rows of 20% of
    # the elements (up to 5% more before it ranks them) and the tensor being handed off; with
    # data > 1 also what waits for the data all-reduce: a bucket being filled and one in
    # flight, 0.05 MiB each, about a fifth of a rank's gradients on x = 2 (at sparsity 0.6
    # that made every gradient of the 4-rank data x x grid alive at once)
    assert r["full_selection_grad_fraction"] == pytest.approx(1.0), label
    bound = 0.85 if r["shape"][0] == 1 else 0.98
    assert 0 < r["selection_grad_fraction"] < bound, f"{label}: {r['selection_grad_fraction']}"


def test_blockllm_choose_rows() -> None:
    """Blocks by descending norm while they fit, ties in (tensor, row) order, a block larger
    than the budget passed over (the steepest taken when every block is), unseen tensors None;
    and a block that leaves the choice as more tensors are seen never comes back, so ranking
    only the choice so far and the new tensor's rows gives the same choice."""
    from fourfold.train.methods.blockllm import choose_rows

    a, b = torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64), torch.tensor([2.0, 5.0],
                                                                           dtype=torch.float64)
    rows = lambda chosen: [None if c is None else c.tolist() for c in chosen]  # noqa: E731
    assert rows(choose_rows([a, None], [4, 10], budget=8)) == [[0, 2], None]
    # b's rows are 10 wide: its 5.0 ranks first but never fits a budget of 8
    assert rows(choose_rows([a, b], [4, 10], budget=8)) == [[0, 2], []]
    assert rows(choose_rows([a, b], [4, 10], budget=14)) == [[0], [1]]
    # a tie (2.0 in both): the first tensor's row first
    assert rows(choose_rows([a, b], [4, 4], budget=12)) == [[0, 2], [1]]
    assert rows(choose_rows([a, b], [40, 40], budget=8)) == [[], [1]]  # none fits: the steepest
    g = torch.Generator().manual_seed(0)
    norms = [torch.rand(n, generator=g, dtype=torch.float64) for n in (7, 3, 11, 5)]
    sizes, budget = [3, 5, 2, 4], 30
    held = [set() for _ in norms]
    kept: list = [None] * len(norms)  # the streamed choice: ranked again from its own rows only
    for k in range(1, len(norms) + 1):
        chosen = choose_rows(norms[:k] + [None] * (len(norms) - k), sizes, budget)
        for i in range(k):
            now = set(chosen[i].tolist())
            assert i == k - 1 or now <= held[i], (k, i)
            held[i] = now
        assert sum(len(h) * s for h, s in zip(held, sizes)) <= budget
        rows_of = [None if i >= k else torch.arange(norms[i].numel()) if i == k - 1 else kept[i]
                   for i in range(len(norms))]
        kept = choose_rows([None if r is None else norms[i][r] for i, r in enumerate(rows_of)],
                           sizes, budget, rows_of)
        assert [None if c is None else c.tolist() for c in kept] == \
            [None if c is None else c.tolist() for c in chosen], k


@pytest.mark.slow
def test_blockllm_selection_streams_gradient_norms() -> None:
    """One process, at the default sparsity and with two micro-steps per step (the hand-off
    waits for their sum): the streamed selection picks the rows the full backward picks, from
    the same norms, and trains alike; with one micro-step it holds a fraction of the gradients
    at once (with two, every gradient lives until the second one's backward has added to it).
    Rows that stay chosen across a reselection keep their moments and step counts."""
    from lean_worker import batches, freeze, full_backward_blockllm, run_method

    from fourfold.config import TrainConfig, model_config
    from fourfold.models import build_model
    from fourfold.parallel import Grid, parallelize

    cfg = model_config("debug", bias=True, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    for sparsity, accum in ((0.9, 1), (0.6, 2)):
        tcfg = TrainConfig(optimizer="blockllm", lr=SUBSET_LR, grad_accum=accum,
                           method=method_options("blockllm", sparsity=sparsity, patience=1,
                                                 **ROW_BLOCKS))
        data = batches(cfg.vocab_size, 2, accum) * 4
        runs = {}
        for kind, cls in (("streamed", None), ("full", full_backward_blockllm())):
            model = build_model(cfg, seed=7)
            freeze(model, ("k_proj.bias",))
            runs[kind] = run_method(parallelize(model, Grid.single()), tcfg, data, cls)
        label = f"sparsity {sparsity}, accum {accum}"
        full_losses, full = runs["full"]
        total = 4 * sum(full.sizes.values())  # every candidate's gradient, float32
        assert len(full.selections) >= 3, label
        losses, method = runs["streamed"]
        assert losses == full_losses, label
        assert [s["selected"] for s in method.selections] == \
            [s["selected"] for s in full.selections], label
        assert [s["norms"] for s in method.selections] == \
            [s["norms"] for s in full.selections], label
        assert full.peak_grad_bytes == total, label
        if accum == 1:  # 10% of the elements and the embedding (handed off last)
            assert 0 < method.peak_grad_bytes < 0.45 * total, \
                f"{label}: {method.peak_grad_bytes / total}"
        else:
            assert method.peak_grad_bytes == total, label
        assert all(v.param.grad is None for _, m in runs.values() for v in m.views)
        if accum == 1:  # held rows ranked when they outgrow the budget, not at each hand-off,
            # and rows below the floor dropped at their hand-off (the same choice as above)
            assert 1 <= method.rankings < len(method.cands) - 1, label
            assert method.dropped_at_hand_off > 0, label
        # the elements chosen fill the budget to within one row
        widest = max(c.row_size for c in method.cands)
        assert method.budget - widest < method.selected_elements() <= method.budget, label
        kept = [method.selections[k]["selected"] for k in (-2, -1)]
        steps = {c.view.name: method.state[i]["step"] for i, c in enumerate(method.cands)
                 if i in method.state}
        assert any(float(t.max()) > 1 for t in steps.values()), label  # a row stayed chosen
        assert kept[0] != kept[1], label


@pytest.mark.slow
def test_galore_basis_spans_the_svds_subspace() -> None:
    """GaLore's projection from the small side's float64 Gram: the subspace of the top r
    singular vectors (projectors against a float64 SVD's), on either side, in chunks of the
    long side or in one; and through GaLore._projection, the shard's rows of it, and of the
    larger side's basis made from it (U = G V / sigma)."""
    from fourfold.config import TrainConfig, model_config
    from fourfold.models import build_model
    from fourfold.parallel import Grid, parallelize
    from fourfold.parallel.comm import Comm
    from fourfold.train.methods.galore import GaLore, small_side_gram, top_eigenvectors

    comm = Comm(Grid.single())
    g = torch.Generator().manual_seed(3)
    for m, n, r in ((300, 40, 7), (40, 300, 10), (64, 64, 16), (50, 20, 20)):
        grad = torch.randn(m, n, generator=g)
        left = m < n
        u, _, vh = torch.linalg.svd(grad.double(), full_matrices=False)
        ref = u[:, :r] if left else vh[:r].T
        for chunk_bytes in (1000, 1 << 30):  # 3-7 chunks, one
            gram = small_side_gram(grad if left else grad.T, (), (), comm, chunk_bytes)
            assert gram.dtype == torch.float64 and gram.shape == (min(m, n),) * 2
            basis = top_eigenvectors(gram, r).double()
            label = f"{m} x {n}, r {r}, chunk {chunk_bytes}"
            assert basis.shape == (min(m, n), r), label
            torch.testing.assert_close(basis.T @ basis, torch.eye(r, dtype=torch.float64),
                                       atol=1e-6, rtol=0, msg=label)
            diff = (basis @ basis.T - ref @ ref.T).abs().max()
            assert diff < 1e-6, f"{label}: {diff}"
    # the method's own path on the tiny model's matrices (one process: every row kept), the
    # smaller side's basis from its Gram, the larger side's from it ("reverse_std" and "full")
    cfg = model_config("debug", bias=True, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    every = ["q", "k", "v", "o", "gate", "up", "down", "output", "embed"]
    for proj_type in ("std", "reverse_std", "full"):
        method = GaLore(parallelize(build_model(cfg, seed=0), Grid.single()),
                        TrainConfig(optimizer="galore", method=method_options(
                            "galore", rank=8, targets=every, proj_type=proj_type)))
        for view in (v for v in method.views if v.param.dim() == 2):
            (m, n), r = view.full_shape, 8
            assert method.sides[view.name], view.name  # every matrix is a target
            grad = torch.randn(m, n, generator=g)
            bases = method._projection(view, grad, None)
            u, _, vh = torch.linalg.svd(grad.double(), full_matrices=False)
            svd = {"left": u[:, :r], "right": vh[:r].T}
            for side in method.sides[view.name]:
                field = "proj_right" if side == "right" and proj_type == "full" else "proj"
                basis = bases[field].double()
                torch.testing.assert_close(basis.T @ basis, torch.eye(r, dtype=torch.float64),
                                           atol=1e-5, rtol=0, msg=view.name)
                diff = (basis @ basis.T - svd[side] @ svd[side].T).abs().max()
                assert diff < 1e-5, f"{proj_type} {view.name} {side}: {diff}"
            if proj_type == "full":  # P^T G Q: the top r singular values on the diagonal
                low = bases["proj"].double().T @ grad.double() @ bases["proj_right"].double()
                _, s, _ = torch.linalg.svd(grad.double())
                torch.testing.assert_close(low.diagonal().abs(), s[:r], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_galore_updates_bfloat16_weights_as_float32_ones() -> None:
    """A library user's model cast to bfloat16: GaLore's float32 step is added through the
    weight's own dtype (the GEMM cannot write float32 into bfloat16), and each matrix moves
    as the same model's float32 weights do after one step (cosine of the updates; the
    bfloat16 forward's gradients differ a little: 0.947 the lowest seen)."""
    import copy

    from fourfold.config import TrainConfig, model_config
    from fourfold.models import build_model
    from fourfold.parallel import Grid, parallelize
    from fourfold.train.methods import StepData, build_method

    # scale 1 and eps 1e-8: the test is about the step reaching bfloat16 weights. At the
    # paper's scale 0.25 a step is a quarter of bfloat16's spacing of the tiny model's
    # weights, and at galore-torch's eps 1e-6 (before the bias correction) Adam's first step
    # is linear in the small entries of R, where bfloat16's rounding shows
    cfg = TrainConfig(optimizer="galore", lr=1e-3, seq_len=16,
                      method=method_options("galore", rank=8, eps=1e-8, scale=1.0))
    base = build_model(model_config("debug"), seed=0).to(torch.bfloat16)
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    updates = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = copy.deepcopy(base).to(dtype)
        before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        pmodel = parallelize(model, Grid.single(), blocked_loss=True)
        method = build_method(pmodel, cfg)
        method.step(pmodel, StepData.one_batch(pmodel, tokens, cfg.dtype), cfg.lr)
        assert all(p.dtype == dtype for p in model.parameters())
        updates[dtype] = {n: p.detach().float() - before[n]
                          for n, p in model.named_parameters() if p.dim() == 2}
    for name, ref in updates[torch.float32].items():
        got = updates[torch.bfloat16][name]
        assert ref.norm() > 0, name
        cosine = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
        assert cosine > 0.9, f"{name}: {float(cosine):.3f}"


class PhaseCounts:
    """PhaseHooks (train/methods/base.py) that count each call, and note for after_forward
    whether the forward's autocast had ended and the weights were still the step's first."""

    def __init__(self, pmodel) -> None:
        from fourfold.train.methods import PhaseHooks

        self.pmodel, self.calls, self.clean = pmodel, [], []
        self.start: list[torch.Tensor] = []
        self.hooks = PhaseHooks(**{name: self._counter(name) for name in (
            "step_start", "after_forward", "before_forward", "before_update",
            "before_transient")})

    def _counter(self, name: str):
        def call() -> None:
            self.calls.append(name)
            if name == "after_forward":
                self.clean.append(not torch.is_autocast_enabled("cpu") and all(
                    torch.equal(p, q) for p, q in zip(self.pmodel.parameters(), self.start)))
        return call

    def step(self, method, tokens: torch.Tensor, dtype: str = "float32", guard=None) -> dict:
        """One step; the calls it made, by phase."""
        from fourfold.train.methods import StepData

        self.calls.clear()
        self.start = [p.detach().clone() for p in self.pmodel.parameters()]
        method.step(self.pmodel, StepData.one_batch(self.pmodel, tokens, dtype), lr=1e-3,
                    guard=guard)
        return {name: self.calls.count(name) for name in set(self.calls)}


@pytest.mark.slow  # a first AdamW imports torch._dynamo: seconds
@pytest.mark.parametrize("optimizer, options, dtype, expected", [
    # a GaLore refresh (steps 0 and 2 of gap 2): one transient per matrix ("M")
    ("galore", {"gap": 2}, "float32", [
        {"step_start": 1, "after_forward": 1, "before_transient": "M", "before_update": 1},
        {"step_start": 1, "after_forward": 1, "before_update": 1}]),
    ("lomo", {"clip_mode": "value"}, "bfloat16", [{"step_start": 1, "after_forward": 1}] * 2),
    ("lomo", {"clip_mode": "two_pass"}, "float32", [{"step_start": 1, "after_forward": 2}] * 2),
    ("adalomo", {}, "float32", [{"step_start": 1, "after_forward": 1}] * 2),
    ("mezo", {}, "float32", [{"before_forward": 2}] * 2),
    ("es", {"population": 3}, "float32", [{"before_forward": 3}] * 2),
    ("blockllm", {}, "float32", [{"step_start": 1}] * 2),
    ("adamw", {}, "float32", [{}] * 2)])
def test_methods_call_their_phase_hooks(optimizer: str, options: dict, dtype: str,
                                        expected: list) -> None:
    """Each method calls its hooks at its phases' boundaries, once each (the host-memory
    policy hands them what it does there: tests/test_host_memory.py): after_forward once a
    micro-step's forward (two_pass: two forwards), after autocast ended and before a weight
    moved; a step the guard skips has no update."""
    from fourfold.config import TrainConfig, model_config
    from fourfold.models import build_model
    from fourfold.parallel import Grid, parallelize
    from fourfold.train.methods import build_method

    cfg = model_config("debug", dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    pmodel = parallelize(build_model(cfg, seed=1), Grid.single(), blocked_loss=True)
    counts = PhaseCounts(pmodel)
    method = build_method(pmodel, TrainConfig(optimizer=optimizer, dtype=dtype,
                                              method=method_options(optimizer, **options)),
                          hooks=counts.hooks)
    # "M": GaLore's projected matrices (its targets)
    matrices = (sum(1 for v in method.views if method.sides[v.name])
                if optimizer == "galore" else 0)
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    for want in expected:
        assert counts.step(method, tokens, dtype) == {
            k: matrices if v == "M" else v for k, v in want.items()}
    if any("after_forward" in want for want in expected):
        assert counts.clean and all(counts.clean)
    if optimizer == "galore":  # a skipped step: no update (step 2 refreshes)
        assert counts.step(method, tokens, guard=Refuse()) == {
            "step_start": 1, "after_forward": 1, "before_transient": matrices}
    if optimizer in ("mezo", "es", "blockllm"):  # skipped steps evaluate all the same
        assert counts.step(method, tokens, guard=Refuse()) == expected[0]


@pytest.mark.ranks
def test_fused_methods_train_as_one_process(tmp_path: Path) -> None:
    grids = [[1, 2, 1, 1], [2, 1, 1, 1], [1, 1, 2, 1], [1, 1, 1, 2]]
    for r in run_worker(2, grids, LOMO_CHECKS + ADALOMO_CHECKS + [BLOCKLLM, GALORE], tmp_path):
        name = r["check"]["name"]
        if name in ("blockllm", "galore"):
            check_subset_method(r)
            continue
        check_trains_as_one_process(r)
        label = (f"grid {r['shape']} rank {r['rank']} {name} "
                 f"{r['check'].get('method', {}).get('clip_mode', 'none')}")
        if name == "adalomo":  # row and column statistics: far less than AdamW's two moments
            assert 0 < r["state_bytes"] < 0.1 * r["trainable_bytes"], label
            assert r["meta"]["steps_done"] == r["check"]["steps"], label
            r["state_bytes"] = 0
            if "own_collectives" in r:  # every weight trainable, no two_pass
                check_own_collectives(r, label)
        assert r["grads_left"] == [], label  # every gradient was freed after its update
        # never all gradients at once; with every weight trainable, under half of them (the
        # tiny model's embedding alone is a fifth, and with the norms waits for the end)
        bound = 1.0 if r["check"].get("freeze") else 0.5
        assert 0 < r["peak_grad_fraction"] < bound, f"{label}: {r['peak_grad_fraction']}"
        assert r["state_bytes"] == 0, label


def test_lomo_is_sgd_fused_into_backward() -> None:
    from fourfold.config import TrainConfig, model_config
    from fourfold.models import build_model
    from fourfold.parallel import Grid, parallelize
    from fourfold.train.methods import StepData, build_method

    cfg = model_config("debug", dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    tokens = torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(0))
    lomo_model, sgd_model = build_model(cfg, seed=1), build_model(cfg, seed=1)
    pmodel = parallelize(lomo_model, Grid.single())
    method = build_method(pmodel, TrainConfig(optimizer="lomo"))  # "auto": no weight decay
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1)
    for _ in range(3):
        data = StepData.one_batch(pmodel, tokens)
        method.step(pmodel, data, lr=0.1)
        sgd_model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
        sgd.step()
        sgd.zero_grad(set_to_none=True)
    for (name, a), b in zip(lomo_model.named_parameters(), sgd_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert method.peak_grad_bytes < 0.5 * sum(p.numel() * 4 for p in lomo_model.parameters())


def test_lomo_refuses_what_it_cannot_do() -> None:
    from fourfold.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.grad_accum = 2: lomo updates each weight"):
        load_config(None, ["train.optimizer=lomo", "train.grad_accum=2"])
    with pytest.raises(ConfigError,
                       match='train.nan_policy = "skip" needs train.method.clip_mode'):
        load_config(None, ["train.optimizer=lomo", "train.nan_policy=skip"])
    load_config(None, ["train.optimizer=lomo", "train.nan_policy=skip",
                       "train.method.clip_mode=two_pass"])


@pytest.mark.ranks
def test_every_method_on_four_rank_grids(tmp_path: Path) -> None:
    """Several axes at once: z and y split the same matrices' rows, data with x."""
    checks = [{"name": "frozen"}, MEZO, ES, LOMO_CHECKS[0], ADALOMO_CHECKS[1], BLOCKLLM, GALORE]
    for r in run_worker(4, [[1, 2, 2, 1], [2, 1, 1, 2]], checks, tmp_path):
        if r["check"]["name"] == "frozen":
            check_frozen(r)
        elif r["check"]["name"] in ("blockllm", "galore"):
            check_subset_method(r)
        else:
            check_trains_as_one_process(r)
            assert r["grads_left"] == [], (r["shape"], r["rank"])


# ---- the planner's memory per method, and train.memory_report ----------------------------------


@pytest.mark.slow
def test_planner_state_bytes_follow_the_method() -> None:
    """Each method's planner model (plan/methods): its gradients and state, against what the
    method itself holds after a step (one process, the tiny model)."""
    from fourfold.config import TrainConfig, model_config
    from fourfold.models import build_model
    from fourfold.parallel import Grid, GridShape, parallelize
    from fourfold.plan.memory import Precision
    from fourfold.plan.methods import method_model
    from fourfold.train.methods import StepData, build_method

    def method_state_bytes(mcfg, shape: GridShape, cfg: TrainConfig) -> dict[str, int]:
        state = method_model(cfg.optimizer).state(mcfg, shape, cfg, Precision.of("float32"))
        return {"grads": state.grads, "optimizer": state.optimizer}

    mcfg = model_config("debug", bias=True, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    one = GridShape(1, 1, 1, 1)
    tokens = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    numel = build_model(mcfg, seed=0).num_params()
    predicted = {}
    for name in ("adamw", "lomo", "adalomo", "mezo", "es", "blockllm", "galore"):
        # galore: every matrix projected (the tiny model's embedding and output layer are
        # half its weights)
        extra = {"es": {"population": 2}, "blockllm": ROW_BLOCKS,
                 "galore": {"targets": GALORE["method"]["targets"]}}.get(name, {})
        cfg = TrainConfig(optimizer=name, method=method_options(name, **extra))
        predicted[name] = method_state_bytes(mcfg, one, cfg)
        pmodel = parallelize(build_model(mcfg, seed=0), Grid.single())
        method = build_method(pmodel, cfg)
        data = StepData.one_batch(pmodel, tokens)
        method.step(pmodel, data, lr=1e-3)
        if name != "blockllm":  # blockllm's selection fills its share to within a row
            assert method.state_bytes() == predicted[name]["optimizer"], name
        else:
            assert 0.98 * predicted[name]["optimizer"] < method.state_bytes() \
                <= predicted[name]["optimizer"], name
        if name == "adamw":  # every gradient at once
            assert method.peak_grad_bytes == predicted[name]["grads"], name
        elif name in ("lomo", "adalomo", "blockllm", "galore"):
            # blockllm: the selection's backward; galore: every matrix's R, the vectors' and
            # the gradient being handed off
            assert 0 < method.peak_grad_bytes <= predicted[name]["grads"], name
    assert predicted["adamw"] == {"grads": 4 * numel, "optimizer": 8 * numel}
    assert predicted["mezo"] == predicted["es"] == {"grads": 0, "optimizer": 0}
    assert predicted["lomo"]["optimizer"] == 0 < predicted["lomo"]["grads"] < numel
    assert 0 < predicted["adalomo"]["optimizer"] < 0.1 * predicted["adamw"]["optimizer"]
    assert predicted["blockllm"]["optimizer"] == pytest.approx(0.1 * 8 * numel, rel=1e-2)
    # the paper's whole tensors, the embedding and output layer frozen: within the planned
    cfg = TrainConfig(optimizer="blockllm", method=method_options("blockllm",
                                                                  first_choice="gradient"))
    paper = method_state_bytes(mcfg, one, cfg)
    pmodel = parallelize(build_model(mcfg, seed=0), Grid.single())
    method = build_method(pmodel, cfg)
    method.step(pmodel, StepData.one_batch(pmodel, tokens), lr=1e-3)
    assert 0.5 * paper["optimizer"] < method.state_bytes() <= paper["optimizer"]
    assert 0 < method.peak_grad_bytes <= paper["grads"]
    assert paper["optimizer"] < 0.7 * predicted["blockllm"]["optimizer"]
    # a selection holds 10% of the gradients, the vectors and the tensor being handed off
    assert predicted["blockllm"]["grads"] < 0.5 * predicted["adamw"]["grads"]
    accum = method_state_bytes(mcfg, one, TrainConfig(optimizer="blockllm", grad_accum=2))
    assert accum["grads"] == predicted["adamw"]["grads"]  # the micro-steps' sum is held
    assert 0.2 < predicted["galore"]["optimizer"] / predicted["adamw"]["optimizer"] < 0.6
    # R is a quarter of the matrices' gradients at the default rank
    assert predicted["galore"]["grads"] < 0.6 * predicted["adamw"]["grads"]
    accum = method_state_bytes(mcfg, one, TrainConfig(optimizer="galore", grad_accum=2))
    assert accum["grads"] == predicted["adamw"]["grads"]
    # a sparser selection, a lower GaLore rank: less state; on 4 ranks: a quarter or less
    sparse = method_state_bytes(mcfg, one, TrainConfig(
        optimizer="blockllm", method=method_options("blockllm", sparsity=0.95)))
    assert sparse["optimizer"] < predicted["blockllm"]["optimizer"]
    low = method_state_bytes(mcfg, one, TrainConfig(optimizer="galore",
                                                    method=method_options(
                                                        "galore", rank=4,
                                                        targets=GALORE["method"]["targets"])))
    assert low["optimizer"] < predicted["galore"]["optimizer"]
    split = method_state_bytes(mcfg, GridShape(1, 2, 2, 1), TrainConfig(optimizer="adalomo"))
    assert split["optimizer"] < predicted["adalomo"]["optimizer"]


def test_planner_counts_the_methods_transients() -> None:
    """GaLore's transient after backward, the largest matrix's: its refresh (the small side's
    float64 Gram, a gathered chunk, eigh) or its update (a block of R and of the step
    projected back to the shard, and P gathered); it counts in the total. MeZO's and ES's no-grad loss."""
    import dataclasses

    from fourfold.config import TrainConfig, model_config
    from fourfold.parallel import GridShape
    from fourfold.parallel.embedding import (NO_GRAD_LOSS_BLOCK_ELEMENTS, output_loss_columns,
                                             resolve_output_loss)
    from fourfold.methods.galore import CHUNK_BYTES as GALORE_CHUNK_BYTES
    from fourfold.plan.memory import Precision, predict_memory, predict_method_memory
    from fourfold.plan.methods.galore import galore_update_bytes

    mcfg = model_config("debug", bias=True, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    m, n = mcfg.vocab_size, mcfg.dim
    # every matrix a target: the embedding is the largest
    cfg = TrainConfig(optimizer="galore", method=method_options("galore", targets=[
        "q", "k", "v", "o", "gate", "up", "down", "output", "embed"]))
    k, p = min(m, n), Precision.of("float32")
    r = k // 4
    one, grid = GridShape(1, 1, 1, 1), GridShape(1, 1, 2, 2)
    # the embedding's (vocab over y, dim over x): Q (cols x r) with its r split over y, R
    # (rows x r) with its r split over x; one block of rows (under GALORE_CHUNK_BYTES)
    for shape, rows, cols in ((one, m, n), (grid, m // 2, n // 2)):
        width = min(GALORE_CHUNK_BYTES // (4 * k), rows)
        refresh = max(8 * k * k + 12 * k * width, 32 * k * k)
        assert 4 * cols * rows < GALORE_CHUNK_BYTES
        gathered = cols * r if shape.y > 1 else 0
        low = r * rows
        update = 4 * (gathered + cols * rows + low + 2 * (low // shape.x))
        assert galore_update_bytes(mcfg, shape, cfg) == max(refresh, update), shape
    for shape in (one, grid):
        base = predict_memory(mcfg, shape, 256, True, p, on_host=True, output_loss="whole")
        galore = predict_method_memory(base, mcfg, shape, cfg, p, output_loss="whole")
        assert galore.update == galore_update_bytes(mcfg, shape, cfg) > 0
        without = dataclasses.replace(galore, update=0)
        assert galore.total == without.total + max(0, galore.update - max(
            without.step, without.startup, without.export))
        adamw = predict_method_memory(base, mcfg, shape, TrainConfig(optimizer="adamw"), p,
                                      output_loss="whole")
        assert adamw.update == 0 and adamw.total == base.total
        # forwards only: no saved activations; the loss's peak is the float32 logits and one
        # block of rows of its temporaries (the whole logits here: fewer than a block)
        logits = 256 * (m // shape.y)
        assert logits <= NO_GRAD_LOSS_BLOCK_ELEMENTS
        for name in ("mezo", "es"):
            zo = predict_method_memory(base, mcfg, shape, TrainConfig(optimizer=name), p,
                                       output_loss="whole")
            assert zo.activations == zo.grads == zo.optimizer == zo.update == 0, name
            assert zo.logits == 2 * logits * 4 == base.logits, name
        big = predict_memory(mcfg, shape, 256 * 64, True, p, on_host=True, output_loss="whole")
        zo = predict_method_memory(big, mcfg, shape, TrainConfig(optimizer="mezo"), p,
                                   output_loss="whole")
        assert zo.logits == 4 * (64 * logits + NO_GRAD_LOSS_BLOCK_ELEMENTS) < big.logits
        # the output layer and the loss in blocks of the vocabulary (parallel.output_loss
        # "blocks"; "auto" for the lean methods): one block of float32 logits and
        # two floats a token; with a backward also the output layer's weight gradient
        columns = min(m // shape.y, output_loss_columns(256 * 64))
        blocked = predict_memory(mcfg, shape, 256 * 64, True, p, on_host=True,
                                 output_loss="blocks")
        forward = 4 * 256 * 64 * (columns + 2)
        assert blocked.logits == forward + 4 * m * n // (shape.x * shape.y)
        assert forward < zo.logits
        for name in ("adamw", "lomo"):
            assert predict_method_memory(blocked, mcfg, shape, TrainConfig(optimizer=name), p,
                                         output_loss="blocks").logits == blocked.logits
        assert predict_method_memory(blocked, mcfg, shape, TrainConfig(optimizer="mezo"), p,
                                     output_loss="blocks").logits == forward
        # "auto": AdamW keeps whole logits; LOMO, MeZO and GaLore take blocks
        assert predict_memory(mcfg, shape, 256 * 64, True, p, on_host=True).logits == \
            big.logits
        for name, lean in (("adamw", False), ("galore", True), ("lomo", True), ("mezo", True)):
            mode = resolve_output_loss("auto", method_spec(name).blocked_loss)
            assert mode == ("blocks" if lean else "whole"), name


def test_a_step_peak_is_the_largest_of_the_loss_and_the_ends_of_backward() -> None:
    """MemoryBreakdown.step: the logits are gone before any block's backward starts, and from
    the first block's backward to the last one's the saved activations go while the gradients
    come, so the step counts the largest of the loss, the first block's backward (every
    activation but the final norm's and the output layer's, the gradients of the output
    layer, the final norm and that block) and the last one's (that block's and the embedding's
    activations, every gradient); MeZO's and ES's block term is a no-grad forward's, and grows
    with the tokens."""
    from fourfold.config import TrainConfig, model_config
    from fourfold.parallel import GridShape
    from fourfold.plan.memory import (Precision, block_transient_bytes_per_token,
                                      predict_memory, predict_method_memory)
    from fourfold.plan.schedule import local_param_numel

    mcfg, one, p = model_config("small"), GridShape(1, 1, 1, 1), Precision.of("float32")
    numel = sum(local_param_numel(mcfg, one).values())
    vocab, layer = mcfg.vocab_size * mcfg.dim, (numel - 2 * mcfg.vocab_size * mcfg.dim
                                                - mcfg.dim) // mcfg.n_layers
    head = 2 * mcfg.dim * 4 + 4  # the final norm's input, output and rstd
    for ckpt in (True, False):
        for tokens in (64, 8192):  # the logits larger, then a block's backward
            m = predict_memory(mcfg, one, tokens, ckpt, p, output_loss="whole")
            saved = (mcfg.dim * 4 if ckpt else
                     (m.activations - tokens * (head + 9)) // tokens // mcfg.n_layers)
            assert m.recompute == (m.activations - tokens * mcfg.n_layers * mcfg.dim * 4
                                   - tokens * (2 * mcfg.dim * 4 + 13) if ckpt else 0)
            assert m.block_transient == tokens * 3 * mcfg.ffn_dim * 4
            assert m.head_activations == tokens * head
            assert m.last_block_activations == tokens * (saved + 9)
            assert m.first_block_grads == (vocab + mcfg.dim + layer) * 4 < m.grads
            alive = m.gathered_weights
            # no gradient exists at the loss (AdamW sets them to None before the forward)
            assert m.loss_grads == 0
            at_loss = m.activations - m.recompute + m.logits
            first = (m.activations - m.head_activations + m.block_transient
                     + m.first_block_grads)
            last = m.last_block_activations + m.recompute + m.block_transient + m.grads
            assert m.step == alive + max(at_loss, first, last)
            assert m.total == m.params + m.optimizer + max(m.step, m.grads, m.startup, m.export)
            # accumulating micro-steps: every gradient is there at the later losses, and
            # through the first block's backward
            accum = predict_memory(mcfg, one, tokens, ckpt, p, output_loss="whole", grad_accum=2)
            assert accum.loss_grads == accum.grads == m.grads
            assert accum.step == alive + max(at_loss + m.grads, first - m.first_block_grads
                                             + m.grads, last)
        assert m.logits < m.recompute + m.block_transient  # 8192 tokens: the block's is larger
    # with data > 1 the first block's bucket is made whole at its first gradient
    shape = GridShape(data=2, z=1, y=1, x=1)
    bucketed = predict_memory(mcfg, shape, 64, True, p, output_loss="whole", bucket_bytes=1000)
    assert bucketed.first_block_grads == m.first_block_grads + 1000
    per_token = block_transient_bytes_per_token(mcfg, one, p, backward=False)
    assert per_token == 3 * mcfg.dim * 4 + 4 * mcfg.ffn_dim * 4
    for tokens in (256, 4096):
        base = predict_memory(mcfg, one, tokens, True, p, output_loss="blocks")
        zo = predict_method_memory(base, mcfg, one, TrainConfig(optimizer="mezo"), p, "blocks")
        assert zo.recompute == zo.activations == 0 and zo.block_transient == tokens * per_token
        assert zo.step == max(zo.logits, zo.block_transient)


def test_preflight_check_uses_the_methods_memory() -> None:
    """build_run's check: a capacity that AdamW's run exceeds but MeZO's fits."""
    from fourfold.config import load_config
    from fourfold.parallel import GridShape
    from fourfold.plan.errors import PlanError
    from fourfold.plan.memory import predicted_memory
    from fourfold.plan.search import check_grid_fits

    shape = GridShape(1, 1, 1, 1)
    need = {o: predicted_memory(load_config(None, ["model.preset=125m",
                                                   f"train.optimizer={o}"]), shape, True).total
            for o in ("adamw", "mezo", "lomo", "galore", "blockllm")}
    assert need["mezo"] < need["lomo"] < need["blockllm"] < need["adamw"]
    assert need["galore"] < need["adamw"]
    capacity = (need["mezo"] + need["adamw"]) // 2
    check_grid_fits(load_config(None, ["model.preset=125m", "train.optimizer=mezo"]), shape,
                    True, capacity)
    with pytest.raises(PlanError, match="under train.optimizer = 'blockllm': a rank needs"):
        check_grid_fits(load_config(None, ["model.preset=125m", "train.optimizer=blockllm"]),
                        shape, True, need["blockllm"] - 1)


# a small run that writes its memory report (train.memory_report)
REPORT_RUN = ["model.preset=debug", "train.batch_size=4", "train.seq_len=32",
              "train.eval_every=0", "train.eval_batches=0", "train.sample_tokens=0",
              "train.memory_report=true"]


@pytest.mark.usefixtures("fourfold_cache")
@pytest.mark.parametrize("optimizer", ["adamw", "lomo", "galore", "mezo"])
def test_memory_report_in_summary(tmp_path: Path, optimizer: str) -> None:
    from fourfold.config import load_config
    from fourfold.train import Trainer

    cfg = load_config(None, [*REPORT_RUN, "train.steps=3", f"train.optimizer={optimizer}",
                             f"train.activation_checkpointing={optimizer == 'galore'}".lower()])
    Trainer(cfg, tmp_path, progress=False).fit()
    report = json.loads((tmp_path / "summary.json").read_text())["memory_report"]
    (measured,), predicted = report["measured_per_rank"], report["predicted_per_rank"]
    label = f"{optimizer}: {measured} vs {predicted}"
    assert set(measured) == set(predicted) == {"parameters", "gradients", "optimizer_state",
                                               "activations", "communication_buffers"}
    assert measured["parameters"] == predicted["parameters"], label
    assert measured["optimizer_state"] == predicted["optimizer_state"], label
    assert measured["communication_buffers"] == 0, label  # one process: nothing gathered
    if optimizer == "adamw":
        assert measured["gradients"] == predicted["gradients"], label
    elif optimizer == "galore":  # R of every matrix, the vectors', the one being handed off
        assert 0.85 * predicted["gradients"] < measured["gradients"] <= predicted["gradients"], \
            label
        assert measured["gradients"] < 0.5 * measured["parameters"], label
    elif optimizer == "lomo":
        assert 0 < measured["gradients"] <= predicted["gradients"], label
    else:
        assert measured["gradients"] == predicted["gradients"] == 0, label
    if optimizer == "mezo":  # forwards only: nothing saved for backward
        assert measured["activations"] == 0, label
    elif optimizer == "galore":  # checkpointed: the hook does not see one block's recompute
        from fourfold.parallel import GridShape
        from fourfold.plan.memory import Precision, activation_bytes_per_token

        block = 4 * 32 * activation_bytes_per_token(cfg.model, GridShape(1, 1, 1, 1),
                                                    Precision.of("float32"))["block"]
        # nor the output layer's weight gradient, which the planner counts with the blocked
        # loss ("auto" for galore): no tensor autograd saves
        dw = 4 * cfg.model.vocab_size * cfg.model.dim
        assert measured["activations"] < predicted["activations"], label
        assert 0.5 < measured["activations"] / (predicted["activations"] - block - dw) < 2.0, \
            label
    else:
        assert 0.5 < measured["activations"] / predicted["activations"] < 2.0, label
    # the process's whole peak (this pytest process's VmHWM: the imports and more) beside the
    # planner's total for the run
    from fourfold.parallel import GridShape
    from fourfold.plan.memory import predicted_memory

    summary = json.loads((tmp_path / "summary.json").read_text())
    (peak,) = report["peak_bytes_per_rank"]
    assert sum(measured.values()) < peak <= summary["peak_mem_bytes"], label
    assert report["predicted_total_bytes"] == \
        predicted_memory(cfg, GridShape(1, 1, 1, 1), on_host=True).total, label


@pytest.mark.usefixtures("fourfold_cache")
def test_memory_report_of_a_resumed_run_counts_the_checkpoint_library(tmp_path: Path) -> None:
    """A run that resumes loads torch.distributed.checkpoint even when it writes no
    checkpoints: the report's planned total counts the library then."""
    from fourfold.config import load_config
    from fourfold.parallel import GridShape
    from fourfold.plan.memory import CHECKPOINT_LIBRARY_BYTES
    from fourfold.train import Trainer
    from fourfold.plan.memory import predicted_memory

    common = [*REPORT_RUN, "train.optimizer=lomo"]
    Trainer(load_config(None, [*common, "train.steps=2", "checkpoint.every=2"]), tmp_path,
            progress=False).fit()
    cfg = load_config(None, [*common, "train.steps=3", "checkpoint.every=0"])
    trainer = Trainer(cfg, tmp_path, progress=False)
    assert trainer.resumed_from is not None
    trainer.fit()
    report = json.loads((tmp_path / "summary.json").read_text())["memory_report"]
    one = GridShape(1, 1, 1, 1)
    fresh = predicted_memory(cfg, one, on_host=True).total
    assert report["predicted_total_bytes"] == fresh + CHECKPOINT_LIBRARY_BYTES


def test_adalomo_row_blocks_change_nothing_but_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """AdaLomo works on a matrix a row block at a time (no temporary as large as it): tiny
    blocks train as whole matrices do."""
    import fourfold.train.methods.lomo as lomo
    from fourfold.config import TrainConfig, model_config
    from fourfold.models import build_model
    from fourfold.parallel import Grid, parallelize
    from fourfold.train.methods import StepData, build_method

    cfg = model_config("debug", dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))

    def run() -> dict[str, torch.Tensor]:
        model = build_model(cfg, seed=1)
        pmodel = parallelize(model, Grid.single())
        method = build_method(pmodel, TrainConfig(optimizer="adalomo"))
        for _ in range(3):
            data = StepData.one_batch(pmodel, tokens)
            method.step(pmodel, data, lr=1e-2)
        return model.state_dict()

    whole = run()
    monkeypatch.setattr(lomo, "CHUNK_ELEMENTS", 200)  # 1-3 rows of each matrix per block
    blocks = run()
    for name in whole:
        torch.testing.assert_close(blocks[name], whole[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(blocks[n], whole[n]) for n in whole)  # the blocks did differ


@pytest.mark.slow
def test_memory_lean_bench_runs_and_predicts_at_its_dtype() -> None:
    """bench/memory_lean.py --dtype: a run's train.dtype reaches the step (its forward under
    bfloat16 autocast) and the planner's prediction (it asked for float32 whatever the run's
    dtype was before --dtype existed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import memory_lean

    from fourfold.config import model_config
    from fourfold.parallel import GridShape

    args = memory_lean.parser().parse_args(["--methods", "mezo", "--dtype", "bfloat16"])
    sets = memory_lean.method_sets(args, "mezo")
    assert sets == ["train.dtype=bfloat16"]
    row = memory_lean.child("small", "mezo", 2, 1, 32, 4, sets=tuple(sets))
    cfg = memory_lean.train_config("mezo", 32, 4, ["train.dtype=bfloat16"])
    one = GridShape(1, 1, 1, 1)
    mcfg = model_config("small")
    bf16 = memory_lean.predicted_bytes(mcfg, cfg, 32, one)
    assert row["predicted"] == bf16
    assert bf16 != memory_lean.predicted_bytes(mcfg, dataclasses.replace(cfg, dtype="float32"),
                                               32, one)
    assert math.isfinite(row["loss"])
    # the same run in float32 (same weights, noise and batch): autocast changed the forward
    f32 = memory_lean.child("small", "mezo", 2, 1, 32, 4, sets=("train.dtype=float32",))
    assert f32["loss"] != row["loss"] and abs(f32["loss"] - row["loss"]) < 0.1


@pytest.mark.slow
def test_memory_lean_phases_census_counts_the_tensors_in_the_heap() -> None:
    """bench/memory_lean.py --phases: at the largest heap a named call began with, the bytes
    of the tensors Python reaches hold at least the model's weights and the method's state,
    and no more than the heap in use above the run's start (they live in it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import memory_lean

    from fourfold.config import model_config
    from fourfold.models import build_model
    from fourfold.parallel import embedding
    from fourfold.train.methods import zeroth

    before = (vars(embedding._OutputCrossEntropy)["backward"], zeroth.add_noise)
    row = memory_lean.child("debug", "galore", 2, 1, 32, 4, phases=True)
    # what it wrapped to label the phases is put back (the rest of this process runs on)
    assert (vars(embedding._OutputCrossEntropy)["backward"], zeroth.add_noise) == before
    heap, tensors, label = row["census"]
    weights = build_model(model_config("debug"), seed=0, device="meta").num_params() * 4
    assert label.startswith("step ") and " / " in label, label
    assert weights + row["state_bytes"] <= tensors <= heap, (weights, row["state_bytes"],
                                                             tensors, heap)
