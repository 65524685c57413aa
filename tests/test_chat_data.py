"""Chat and instruction data: records -> a chat template -> tokens and which of them are trained.

The template of a Hugging Face tokenizer folder is rendered and tokenized as transformers'
apply_chat_template does it (text, ids and assistant mask compared side by side); a template
without {% generation %} blocks gets the same mask as with them. Bad records are skipped one
line each, naming the record and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fourfold.cli import main as cli_main
from fourfold.data import DataError, Manifest, prepare, verify
from fourfold.data.chat_template import (DEFAULT_TEMPLATE, ChatTemplate, TemplateError,
                                         data_template, default_template, template_for)
from fourfold.data.loader import documents
from fourfold.data.records import BadRecord, conversation
from fourfold.data.tokenizers import ByteTokenizer, load_tokenizer

CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}"
          "{{ message['content'] + '<|im_end|>' + '\n' }}"
          "{% endgeneration %}{% else %}"
          "{{ message['content'] + '<|im_end|>' + '\n' }}"
          "{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_PLAIN = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")

CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass, über-green?"},
    {"role": "assistant", "content": "Green."},
]


def _hf_folder(root: Path, template: str) -> Path:
    """A Hugging Face tokenizer folder: a small byte-level BPE with ChatML's special tokens and
    `template` in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root.mkdir(parents=True, exist_ok=True)
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>",
                                                                   "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = [m["content"] for m in CONVERSATION] * 20 + ["system user assistant"] * 20
    hf.train_from_iterator(text, trainer=trainer)
    hf.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "bos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
              "chat_template": template, "clean_up_tokenization_spaces": False}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def transformers():
    """transformers, imported once for the module (seconds: not the tests' own time)."""
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    return _hf_folder(tmp_path_factory.mktemp("hf") / "tok", CHATML)


@pytest.fixture(scope="module")
def hf_plain_folder(tmp_path_factory) -> Path:
    return _hf_folder(tmp_path_factory.mktemp("hf_plain") / "tok", CHATML_PLAIN)


def _write_jsonl(path: Path, records: list) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def _chats(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"question {i}: what is {i} + {i}?"},
                          {"role": "assistant", "content": f"{2 * i}"}]} for i in range(n)]


# --------------------------------------------------------------------------------------------
# Templates against transformers


def test_a_tokenizer_folders_template_renders_and_tokenizes_as_transformers(hf_folder,
                                                                            transformers):
    reference = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    tok = load_tokenizer(hf_folder)
    template = template_for(str(hf_folder), tok)
    assert template.source == "tokenizer"
    for generation_prompt in (False, True):
        messages = CONVERSATION[:-1] if generation_prompt else CONVERSATION
        expected = reference.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        assert template.render(messages, generation_prompt) == expected
    out = reference.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, trained = template.encode(tok, template.render_spans(CONVERSATION), "assistant")
    assert ids.tolist() == list(out["input_ids"])
    assert trained.tolist() == list(out["assistant_masks"])
    assert 0 < trained.sum() < len(trained)
    # the answer and its end-of-turn mark are trained; the prompt and the role lines are not
    text = tok.decode(ids[trained.astype(bool)])
    assert "Blue." in text and "Green." in text and "sky" not in text


def test_a_template_without_generation_blocks_gets_the_same_mask(hf_folder, hf_plain_folder,
                                                                 transformers):
    reference = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    out = reference.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    tok = load_tokenizer(hf_plain_folder)
    template = template_for(str(hf_plain_folder), tok)
    assert "{% generation %}" not in template.template
    ids, trained = template.encode(tok, template.render_spans(CONVERSATION), "assistant")
    assert ids.tolist() == list(out["input_ids"])
    assert trained.tolist() == list(out["assistant_masks"])
    assert template.end_of_turn() == "<|im_end|>"


def test_the_default_template_is_the_documented_one():
    template = default_template(ByteTokenizer())
    rendered = template.render_spans(CONVERSATION[:3])
    assert rendered.text == ("<|system|>\nYou answer in one word.\n<|user|>\nWhat colour is the "
                             "sky?\n<|assistant|>\nBlue.<|endoftext|>")
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["Blue.<|endoftext|>"]
    assert template.render(CONVERSATION[:2], True).endswith("sky?\n<|assistant|>\n")
    ids, trained = template.encode(ByteTokenizer(), rendered, "assistant")
    assert ids[-1] == 256 and ids.tolist().count(256) == 1  # end-of-text is one token
    assert ByteTokenizer().decode(ids[trained.astype(bool)]) == "Blue."
    assert trained[-1] == 1 and trained.sum() == len("Blue.") + 1
    _, everything = template.encode(ByteTokenizer(), rendered, "all")
    assert everything.all()


def test_the_default_template_exported_renders_the_same_in_transformers(tmp_path, transformers):
    """The default template is jinja that transformers renders alike: with the byte
    tokenizer's export (write_hf_tokenizer), apply_chat_template gives the same ids and mask."""
    from fourfold.data.tokenizers import write_hf_tokenizer

    write_hf_tokenizer(ByteTokenizer(), tmp_path, model_max_length=512)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = DEFAULT_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    out = reference.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    template = default_template(ByteTokenizer())
    ids, trained = template.encode(ByteTokenizer(), template.render_spans(CONVERSATION),
                                   "assistant")
    assert ids.tolist() == list(out["input_ids"])
    assert trained.tolist() == list(out["assistant_masks"])


def test_a_template_that_refuses_a_conversation_is_a_template_error():
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}",
                            {"eos_token": "</s>"}, "tokenizer")
    with pytest.raises(TemplateError, match="roles must alternate"):
        template.render_spans(CONVERSATION)


# --------------------------------------------------------------------------------------------
# Records


def test_instructions_become_a_user_turn_and_an_answer():
    assert conversation("instruct", {"prompt": "P", "completion": "C"}) == [
        {"role": "user", "content": "P"}, {"role": "assistant", "content": "C"}]
    assert conversation("instruct", {"instruction": "I", "input": "X", "output": "O",
                                     "system": "S"}) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "I\n\nX"},
        {"role": "assistant", "content": "O"}]
    assert conversation("instruct", {"instruction": "I", "input": "", "output": "O"})[0] == \
        {"role": "user", "content": "I"}


BAD_RECORDS = [
    ("chat", {"text": "no messages"}, "messages: missing"),
    ("chat", {"messages": []}, "messages: expected a non-empty list"),
    ("chat", {"messages": "hi"}, "messages: expected a non-empty list"),
    ("chat", {"messages": ["hi"]}, "messages[0]: expected an object"),
    ("chat", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role: 'bot'"),
    ("chat", {"messages": [{"content": "x"}]}, "messages[0].role: null"),
    ("chat", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]},
     "messages[1].content: expected a string, got null"),
    ("chat", {"messages": [{"role": "user", "content": 3}]},
     "messages[0].content: expected a string, got a int"),
    ("chat", {"messages": [{"role": "user", "content": "q"}]}, "messages: no assistant message"),
    ("chat", [1, 2], "expected a JSON object, got a JSON array"),
    ("chat", "{not json", "not valid JSON"),
    ("instruct", {"prompt": "p"}, "completion: missing"),
    ("instruct", {"completion": "c"}, "prompt: missing"),
    ("instruct", {"prompt": ["p"], "completion": "c"}, "prompt: expected a string"),
    ("instruct", {"prompt": "p", "completion": ""}, "completion: empty"),
    ("instruct", {"instruction": "i"}, "output: missing"),
    ("instruct", {"output": "o"}, "instruction: missing"),
    ("instruct", {"instruction": "i", "input": 5, "output": "o"}, "input: expected a string"),
    ("instruct", {"instruction": "i", "output": "o", "system": {}}, "system: expected a string"),
    ("instruct", {"question": "q"}, "prompt: missing: expected prompt and completion"),
]


@pytest.mark.parametrize("data_format,record,problem", BAD_RECORDS)
def test_a_bad_record_is_skipped_with_one_line_naming_it_and_its_field(
        tmp_path, data_format, record, problem):
    good = (_chats(6) if data_format == "chat" else
            [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(6)])
    path = _write_jsonl(tmp_path / "in.jsonl", good[:3] + [record] + good[3:])
    lines: list[str] = []
    manifest = prepare([path], tmp_path / "out", data_format=data_format, progress=False,
                       report=lines.append)
    assert manifest.skipped_records == 1 and manifest.documents == 6
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{path}:4: skipped: ") and problem in lines[0], lines[0]
    assert "\n" not in lines[0]


def test_a_record_error_names_the_field():
    with pytest.raises(BadRecord) as info:
        conversation("chat", {"messages": [{"role": "user", "content": "q"},
                                           {"role": "assistant", "content": None}]})
    assert info.value.field == "messages[1].content"


def test_prepare_counts_skipped_records_and_refuses_when_none_is_usable(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "in.jsonl", _chats(4) + [{"messages": []}] * 30)
    code = cli_main(["prepare", str(path), "--out", str(tmp_path / "out"), "--format", "chat"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "prepared 4 chat records (skipped 30 bad records)" in out
    assert err.count("skipped: messages") == 20 and "more skipped records" in err
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}] * 3)
    with pytest.raises(DataError, match="no usable records .* all 3 were skipped"):
        prepare([bad], tmp_path / "out2", data_format="chat", progress=False,
                report=lambda line: None)
    code = cli_main(["prepare", str(path), "--out", str(tmp_path / "o3"), "--train-on", "most",
                     "--format", "chat"])
    assert code == 2 and "error: --train-on 'most': expected one of assistant, all" in \
        capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# The prepared directory


def test_prepared_chat_data_keeps_tokens_masks_documents_and_template(tmp_path, hf_folder):
    records = _chats(12)
    path = _write_jsonl(tmp_path / "chat.jsonl", records)
    out = tmp_path / "data"
    manifest = prepare([path], out, tokenizer=str(hf_folder), data_format="chat",
                       val_fraction=0.2, progress=False)
    assert (manifest.data_format, manifest.train_on, manifest.chat_template) == \
        ("chat", "assistant", "tokenizer")
    assert manifest.has_masks and verify(out) == Manifest.load(out)
    tok = load_tokenizer(out)
    template = data_template(out, tok)
    assert template.template == CHATML
    expected = {}
    for record in records:
        rendered = template.render_spans(record["messages"])
        ids, trained = template.encode(tok, rendered, "assistant")
        expected[tuple(ids.tolist())] = trained.tolist()
    seen = 0
    for name, split in manifest.splits.items():
        tokens = np.fromfile(out / split.shards[0].file, dtype=manifest.dtype).astype(np.int64)
        trained = np.fromfile(out / split.trained[0].file, dtype=np.uint8)
        starts = np.fromfile(out / split.document_index.file, dtype=np.int64)
        assert len(starts) == split.documents and starts[0] == 0
        bounds = list(starts) + [len(tokens)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            key = tuple(tokens[a:b].tolist())
            assert expected[key] == trained[a:b].tolist()  # no EOS appended to a chat
            seen += 1
        assert [d.tolist() for d in documents(out, name, 10**6)] == \
            [tokens[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    assert seen == len(records)


def test_train_on_all_trains_every_token(tmp_path):
    path = _write_jsonl(tmp_path / "chat.jsonl", _chats(5))
    manifest = prepare([path], tmp_path / "out", data_format="chat", train_on="all",
                       progress=False)
    assert manifest.train_on == "all"
    for split in manifest.splits.values():
        assert np.fromfile(tmp_path / "out" / split.trained[0].file, dtype=np.uint8).all()


def test_instruct_records_from_json_arrays_and_parquet(tmp_path):
    alpaca = [{"instruction": f"Say {i}.", "input": "", "output": f"{i}"} for i in range(5)]
    (tmp_path / "alpaca.json").write_text(json.dumps(alpaca))
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(5)],
                             "completion": [f"c{i}" for i in range(5)]}), tmp_path / "pc.parquet")
    manifest = prepare([tmp_path / "alpaca.json", tmp_path / "pc.parquet"], tmp_path / "out",
                       data_format="instruct", progress=False)
    assert manifest.documents == 10 and manifest.chat_template == "default"
    texts = [ByteTokenizer().decode(d) for d in documents(tmp_path / "out", "train", 100)
             + documents(tmp_path / "out", "val", 100)]
    assert "<|user|>\nSay 3.\n<|assistant|>\n3" in texts
    assert "<|user|>\np4\n<|assistant|>\nc4" in texts


def test_a_bpe_trained_on_chats_keeps_end_of_text_one_token(tmp_path):
    path = _write_jsonl(tmp_path / "chat.jsonl", _chats(30))
    out = tmp_path / "out"
    manifest = prepare([path], out, tokenizer="bpe:300", data_format="chat", progress=False)
    tok = load_tokenizer(out)
    doc = documents(out, "train", 1)[0]
    assert doc[-1] == manifest.eos_id == tok.eos_id
    assert (doc == tok.eos_id).sum() == 1


def test_a_text_file_is_not_a_record(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    with pytest.raises(DataError, match="not a file of records"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", data_format="chat", progress=False)
