"""Fine-tuning on chat and instruction data end to end: the built-in instruction set, a run on
it, `fourfold generate --chat` with the run's template, and the goldfish loss and the
memorization audit on chat data."""

from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from fourfold.cli import main as cli_main
from fourfold.config import load_config
from fourfold.data import Manifest, resolve_data_path
from fourfold.data.builtin import (DOCSTRING_INSTRUCTION, DOCSTRING_RECORD_CHARS,
                                   docstring_records)
from fourfold.data.chat_template import data_template
from fourfold.data.loader import documents
from fourfold.data.tokenizers import ByteTokenizer

pytestmark = pytest.mark.usefixtures("fourfold_cache")  # tests/conftest.py


def test_docstring_records_are_functions_without_their_docstrings(tmp_path):
    source = ('import x\n\n'
              'class A:\n'
              '    @property\n'
              '    def size(self):\n'
              '        """How big it is,\n\n        in bytes."""\n'
              '        return 4\n\n'
              'def undocumented():\n    return 1\n\n'
              'def f(a, b):\n    "Add a and b, twice over."\n    c = a + b\n    return 2 * c\n')
    (tmp_path / "m.py").write_text(source)
    records = list(docstring_records([tmp_path / "m.py"]))
    by_answer = {r["completion"]: r["prompt"] for r in records}
    assert sorted(by_answer) == ["Add a and b, twice over.", "How big it is,\n\nin bytes."]
    assert by_answer["How big it is,\n\nin bytes."] == (
        f"{DOCSTRING_INSTRUCTION}\n\n@property\ndef size(self):\n    return 4\n")
    for r in records:
        function = r["prompt"].split("\n\n", 1)[1]
        tree = ast.parse(function)  # the code without its docstring still parses
        assert ast.get_docstring(tree.body[0]) is None


def test_docstring_records_of_the_standard_library_fit_a_row():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / name for name in ("fractions.py", "shlex.py", "textwrap.py", "pathlib.py",
                                      "argparse.py", "statistics.py")]
    records = list(docstring_records([f for f in files if f.is_file()]))
    assert len(records) > 20
    assert all(len(r["prompt"]) - len(DOCSTRING_INSTRUCTION) + len(r["completion"])
               <= DOCSTRING_RECORD_CHARS + 3 for r in records)


@pytest.mark.slow
def test_the_builtin_instruction_set_is_prepared_with_a_held_out_split():
    data_dir = resolve_data_path("builtin:stdlib-docstrings")
    manifest = Manifest.load(data_dir)
    assert (manifest.data_format, manifest.train_on) == ("instruct", "assistant")
    assert manifest.splits["train"].documents > 1000 and manifest.splits["val"].documents > 50
    template = data_template(data_dir, ByteTokenizer())
    text = ByteTokenizer().decode(documents(data_dir, "val", 1)[0])
    assert text.startswith(f"<|user|>\n{DOCSTRING_INSTRUCTION}\n\n") and "<|assistant|>\n" in text
    assert template.source == "default"
    lengths = [len(d) for d in documents(data_dir, "train", 10**6)]
    assert np.percentile(lengths, 99) <= 512  # nearly all fit a row of the example's seq_len


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, fourfold_cache) -> tuple[Path, Path]:
    from test_packing import prepare_chats

    from fourfold.train import train

    root = tmp_path_factory.mktemp("chat_run")
    data_dir = prepare_chats(root, 120, seed=3)
    cfg = load_config(None, ["model.preset=debug", f"data.path={data_dir}",
                             "train.batch_size=4", "train.seq_len=128", "train.steps=3",
                             "train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1",
                             "train.sample_tokens=0", "train.loss=goldfish",
                             "train.goldfish_k=2", "train.log_every=1"])
    train(cfg, root / "run", progress=False)
    return root / "run", data_dir


@pytest.mark.slow
def test_generate_chat_puts_the_prompt_in_the_runs_template(chat_run, capsys, monkeypatch):
    import fourfold.train.sampling as sampling

    run_dir, data_dir = chat_run
    seen: dict = {}
    real = sampling.generate

    def spy(model, prompt_ids, max_new_tokens, **options):  # noqa: ANN001, ANN003
        seen.update(prompt=list(prompt_ids), eos=options["eos_id"])
        return real(model, prompt_ids, max_new_tokens, **options)

    monkeypatch.setattr(sampling, "generate", spy)
    code = cli_main(["generate", "--chat", str(run_dir), "--prompt", "what is 2 + 2?",
                     "--max-new-tokens", "12", "--temperature", "0"])
    out = capsys.readouterr().out
    assert code == 0 and "what is 2 + 2?" not in out  # the answer alone
    assert ByteTokenizer().decode(seen["prompt"]) == \
        "<|user|>\nwhat is 2 + 2?\n<|assistant|>\n"
    assert seen["eos"] == 256  # the default template ends a turn with end-of-text


@pytest.mark.slow
def test_goldfish_and_the_memorization_audit_work_on_chat_data(chat_run, capsys):
    from fourfold.train.metrics import read_metrics

    run_dir, data_dir = chat_run
    fractions = [r["loss_token_fraction"] for r in read_metrics(run_dir / "metrics.jsonl")
                 if "loss_token_fraction" in r]
    trained = np.concatenate([np.fromfile(data_dir / f.file, dtype=np.uint8) for f in
                              Manifest.load(data_dir).splits["train"].trained]).mean()
    # goldfish (k = 2) drops about half of the trained tokens, and never trains the prompts
    assert fractions and all(0 < f < 0.8 * trained for f in fractions), (fractions, trained)
    code = cli_main(["eval", "memorization", str(run_dir), "--data", str(data_dir), "--docs",
                     "8", "--prefix", "16", "--suffix", "8", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["documents_audited"] > 0
    assert 0.0 <= report["token_match_rate"] <= 1.0



@pytest.mark.slow
def test_the_hf_export_of_a_chat_run_renders_its_template_as_prepare_did(chat_run, tmp_path):
    """`fourfold convert` writes the run's chat template: transformers' apply_chat_template on
    the export gives the ids and the assistant mask that prepare stored."""
    transformers = pytest.importorskip("transformers")
    run_dir, data_dir = chat_run
    assert cli_main(["convert", str(run_dir), "--to", "hf", str(tmp_path / "hf")]) == 0
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    messages = [{"role": "user", "content": "what is 2 + 2?"},
                {"role": "assistant", "content": "4"}]
    out = reference.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    template = data_template(data_dir, ByteTokenizer())
    ids, trained = template.encode(ByteTokenizer(), template.render_spans(messages), "assistant")
    assert list(out["input_ids"]) == ids.tolist()
    assert list(out["assistant_masks"]) == trained.tolist()
