"""Packaging at data-prep grade: loss masks, transforms, bad rows, determinism, receipts, kill-and-resume, blends."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.packaging_inputs import chat_records, one_source_blend, packaging_settings, quiet, write_jsonl

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.common.jsonl import RecordError
from nexa_dagster.core.data.splits import is_held_out, is_validation, side_overrides
from nexa_dagster.core.packaging import shards as sh
from nexa_dagster.core.packaging.blend import BlendSource, DataBlend
from nexa_dagster.core.packaging.formats.indexed_dataset import IndexedDataset
from nexa_dagster.core.packaging.formats.packed_split import read_packed_table, split_files, split_lines
from nexa_dagster.core.packaging.jsonl_dataset import package_jsonl, partitions_to_flat_jsonl
from nexa_dagster.core.packaging.packing import PACKED_SCHEMA, ChatTokenizer, check_packed_file
from nexa_dagster.core.packaging.pretrain_corpus import PretrainSettings, package_pretrain
from nexa_dagster.core.packaging.sft_dataset import (
    build_sft_dataset,
    day_inputs_from_frame,
    day_inputs_from_partitions,
    package_sft,
    streamed_side_overrides,
)
from nexa_dagster.core.packaging.transforms import build_transform

OUTPUTS = (
    "train.shards.json",
    "validation.shards.json",
    "train.jsonl.shards.json",
    "validation.jsonl.shards.json",
    "snapshot.json",
)


# -- loss mask ---------------------------------------------------------------------------------------------------


def test_loss_mask_covers_exactly_the_assistant_tokens(tiny_tokenizer, tmp_path: Path) -> None:
    msgs = [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "What is a tuple?"},
        {"role": "assistant", "content": "An immutable sequence."},
        {"role": "user", "content": "And a list?"},
        {"role": "assistant", "content": "A mutable one."},
    ]
    chat = ChatTokenizer.from_hf(tiny_tokenizer, str(tmp_path / "tok.json"))
    ((ids, mask),) = chat.encode_conversations([msgs])
    # the fast path gives exactly the tokens of the rendered template
    rendered = tiny_tokenizer.apply_chat_template(msgs, tokenize=False)
    assert ids.tolist() == tiny_tokenizer.encode(rendered, add_special_tokens=False)
    # hand-built expectation: 1 exactly on each assistant content + its <|im_end|>, 0 everywhere else
    expected: list[int] = []
    for m in msgs:
        head = tiny_tokenizer.encode(f"<|im_start|>{m['role']}\n", add_special_tokens=False)
        body = tiny_tokenizer.encode(m["content"], add_special_tokens=False)
        learn = int(m["role"] == "assistant")
        expected += [0] * len(head) + [learn] * len(body) + [learn] + [0]  # <|im_end|>, then "\n"
    assert mask.tolist() == expected
    learned = np.flatnonzero(mask)
    spans = np.split(ids[learned], np.flatnonzero(np.diff(learned) > 1) + 1)
    assert len(spans) == 2
    assert [tiny_tokenizer.decode(s.tolist()) for s in spans] == [
        "An immutable sequence.<|im_end|>",
        "A mutable one.<|im_end|>",
    ]
    # the chat template's {% generation %} block: Hugging Face's assistant mask is the same mask (TRL's
    # assistant_only_loss and any apply_chat_template user see exactly what the packer learns)
    hf = tiny_tokenizer.apply_chat_template(msgs, return_assistant_tokens_mask=True, return_dict=True)
    assert list(hf["input_ids"]) == ids.tolist()
    assert list(hf["assistant_masks"]) == mask.tolist()


# SmolLM2-135M-Instruct's chat template (its chat_template.jinja): a default system message when a conversation
# opens without one, as Qwen's templates write too
DEFAULT_SYSTEM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_template_with_a_default_system_message_packs_what_it_renders(
    tiny_tokenizer, tmp_path: Path
) -> None:
    """SmolLM2's template (a dense checkpoint the training upcycles) writes a default system message before a
    conversation without one: the packer puts it first, unlearned, and gives the rendered template's tokens with
    a system message and without; the project's own template has no preamble and keeps its run hash's inputs."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = DEFAULT_SYSTEM_TEMPLATE
    chat = ChatTokenizer.from_hf(tokenizer, str(tmp_path / "tok.json"))
    assert tokenizer.decode(list(chat.preamble)).startswith("<|im_start|>system\nYou are a helpful AI")
    answer = {"role": "assistant", "content": "An immutable sequence."}
    for msgs in (
        [{"role": "user", "content": "What is a tuple?"}, answer],
        [
            {"role": "system", "content": "Answer in one line."},
            {"role": "user", "content": "A tuple?"},
            answer,
        ],
    ):
        ((ids, mask),) = chat.encode_conversations([msgs])
        rendered = tokenizer.apply_chat_template(msgs, tokenize=False)
        assert ids.tolist() == tokenizer.encode(rendered, add_special_tokens=False)
        assert tokenizer.decode(ids[mask == 1].tolist()) == "An immutable sequence.<|im_end|>"
    assert "preamble" in chat.describe()
    own = ChatTokenizer.from_hf(tiny_tokenizer, str(tmp_path / "own.json"))
    assert own.preamble == () and "preamble" not in own.describe()
    tokenizer.chat_template = DEFAULT_SYSTEM_TEMPLATE.replace(
        "message['content']", "message['content'] + (loop.index | string)"
    )  # numbers its messages: no per-message rendering exists
    with pytest.raises(ValueError, match="not per-message"):
        ChatTokenizer.from_hf(tokenizer, str(tmp_path / "numbered.json"))


def test_labels_column_is_the_loss_mask_in_the_hugging_face_convention(
    tiny_tokenizer, tmp_path: Path
) -> None:
    """``labels`` = the token id where the trainer learns it, -100 elsewhere (not shifted: the model shifts); the
    trainer reads the stored column, and a labels column that disagrees with the loss mask is caught."""
    import torch

    from nexa_dagster.core.training.data import check_packed, labels_for, load_packed

    path = write_jsonl(tmp_path / "in.jsonl", chat_records(60))
    run = package_sft(
        one_source_blend(path), tiny_tokenizer, str(tmp_path / "out"), packaging_settings(), log=quiet
    )
    frame = read_packed_table(run.paths["train"]).to_pandas()
    for row in frame.itertuples():
        ids, labels, mask = (np.asarray(v) for v in (row.input_ids, row.labels, row.loss_mask))
        starts = np.asarray(row.cu_seqlens[:-1])
        keep = (mask == 1) & (np.arange(len(ids)) < row.num_tokens)
        keep[starts] = False  # a document's first token is never predicted from the document before it
        assert (labels[keep] == ids[keep]).all() and (labels[~keep] == -100).all()
        assert (
            int(keep.sum()) == row.num_loss_tokens
        )  # (the template never starts a document with a learned token)
    data = load_packed(run.paths["train"])
    assert labels_for(data) is data["labels"]  # training reads the stored column: one definition
    assert torch.equal(data["labels"], labels_for({k: v for k, v in data.items() if k != "labels"}))
    assert check_packed_file(run.paths["train"], 256) == []

    # a labels column that disagrees with the loss mask: the packed-file check and the trainer both refuse it
    table = read_packed_table(run.paths["train"])
    bad_labels = [list(v) for v in table.column("labels").to_pylist()]
    bad_labels[3][int(np.flatnonzero(np.asarray(bad_labels[3]) == -100)[0])] = 7
    bad = tmp_path / "bad.parquet"
    pq.write_table(
        table.set_column(
            table.schema.get_field_index("labels"),
            "labels",
            pa.array(bad_labels, table.schema.field("labels").type),
        ),
        bad,
    )
    assert any("row 3 has labels that disagree" in p for p in check_packed_file(str(bad), 256))
    with pytest.raises(ValueError, match=r"bad\.parquet: row 3 has labels that disagree"):
        check_packed(load_packed(str(bad)), str(bad), len(tiny_tokenizer))


# -- transforms and bad rows -------------------------------------------------------------------------------------


def test_the_negative_control_shuffles_each_answers_words_the_same_way_every_time() -> None:
    """The negative control's blend (configs/blends/sft_negative_control.yaml): the answer's words, reordered by a
    seed and the answer's text alone; the prompt and system turns untouched."""
    answer = " ".join(f"w{i}" for i in range(30))
    record = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "explain this excerpt please"},
            {"role": "assistant", "content": answer},
        ]
    }
    control = build_transform(DataBlend.load("blends/sft_negative_control.yaml").sources[0].transform)
    shuffled = control(record)["messages"]
    assert shuffled[:2] == record["messages"][:2]
    assert shuffled[2]["content"] != answer and sorted(shuffled[2]["content"].split()) == sorted(
        answer.split()
    )
    assert control(record) == control(record)  # deterministic: a re-run packs the same bytes
    other_seed = build_transform({"shuffle_answer_words": {"seed": 1}})(record)["messages"][2]["content"]
    assert other_seed != shuffled[2]["content"]


def test_each_transform() -> None:
    assert build_transform("sft")({"input": "q", "output": "a", "system": "s"}) == {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
        ]
    }
    assert build_transform({"sft": {"input_field": "question", "output_field": "answer"}})(
        {"question": "q", "answer": "a"}
    )["messages"][1] == {"role": "assistant", "content": "a"}
    assert build_transform("openai_chat")(
        {
            "messages": [
                {"role": "user", "content": "q", "name": "x"},
                {"role": "assistant", "content": "a"},
            ],
            "id": 3,
        }
    ) == {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert build_transform("sharegpt")(
        {
            "conversations": [
                {"from": "system", "value": "s"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
            ]
        }
    )["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    assert build_transform("passthrough")({"x": [1, {"y": 2}]}) == {"x": [1, {"y": 2}]}
    assert build_transform({"select": ["b", "a"]})({"a": 1, "b": 2, "c": 3}) == {"b": 2, "a": 1}
    assert build_transform({"rename": {"a": "prompt"}})({"a": 1, "c": 3}) == {"prompt": 1, "c": 3}
    chain = build_transform([{"select": ["q", "r"]}, {"rename": {"q": "input", "r": "output"}}, "sft"])
    assert chain({"q": "Q", "r": "R", "junk": 0})["messages"][-1]["content"] == "R"
    with pytest.raises(RecordError, match="field 'output': missing"):
        build_transform("sft")({"input": "q"})
    with pytest.raises(RecordError, match=r"conversations\[1\]\.from.*'bot'"):
        build_transform("sharegpt")(
            {"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]}
        )
    with pytest.raises(RecordError, match="no assistant message"):
        build_transform("openai_chat")({"messages": [{"role": "user", "content": "q"}]})
    with pytest.raises(RecordError, match="field 'z': missing"):
        build_transform({"select": ["a", "z"]})({"a": 1})
    with pytest.raises(ValueError, match="unknown transform 'chatml'"):
        build_transform("chatml")


BAD_ROWS = [
    "",  # empty row
    "{not json",
    json.dumps([1, 2]),
    json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 7}]}),
    json.dumps({"messages": "hello"}),
    json.dumps({}),
]


def test_bad_rows_raise_with_file_line_and_field(tiny_tokenizer, tmp_path: Path) -> None:
    good = chat_records(5)
    for k, bad in enumerate(BAD_ROWS):
        path = write_jsonl(tmp_path / f"in{k}" / "chat.jsonl", [*good[:3], bad, *good[3:]])
        with pytest.raises(RecordError, match=r"chat\.jsonl:4: ") as err:
            package_sft(
                one_source_blend(path),
                tiny_tokenizer,
                str(tmp_path / f"out{k}"),
                packaging_settings(),
                log=quiet,
            )
        print(err.value)
    with pytest.raises(
        RecordError, match=r"chat\.jsonl:4: field 'messages\[1\]\.content': .*must be a string"
    ):
        package_sft(
            one_source_blend(str(tmp_path / "in3" / "chat.jsonl")),
            tiny_tokenizer,
            str(tmp_path / "o"),
            packaging_settings(),
            log=quiet,
        )


def test_bad_rows_quarantined_with_reason(tiny_tokenizer, tmp_path: Path) -> None:
    good = chat_records(30)
    path = write_jsonl(tmp_path / "chat.jsonl", [*good[:10], *BAD_ROWS, *good[10:]])
    run = package_sft(
        one_source_blend(path),
        tiny_tokenizer,
        str(tmp_path / "out"),
        packaging_settings(on_error="quarantine"),
        log=quiet,
    )
    assert run.quarantined_rows == len(BAD_ROWS) and run.rows_read == len(good) + len(BAD_ROWS)
    assert sum(s.documents for s in run.stats.values()) == len(good)
    quarantined = [json.loads(x) for x in Path(run.paths["quarantine"]).read_text().splitlines()]
    assert [q["where"] for q in quarantined] == [f"chat.jsonl:{i}" for i in range(11, 11 + len(BAD_ROWS))]
    reasons = [q["reason"] for q in quarantined]
    assert reasons[0] == "empty row" and reasons[1].startswith("invalid JSON") and "JSON object" in reasons[2]
    assert quarantined[3]["field"] == "messages[1].content"


# -- determinism, receipts, resume -------------------------------------------------------------------------------


def _bytes(root: str) -> dict[str, bytes]:
    return {name: Path(root, name).read_bytes() for name in OUTPUTS}


def _rows(path: str) -> dict[str, list]:
    """A packed split's rows as the trainer reads them (``load_packed``: every column, in order)."""
    from nexa_dagster.core.training.data import load_packed

    return {column: tensor.tolist() for column, tensor in load_packed(path).items()}


def test_byte_identical_whatever_the_workers_and_rerun(
    tiny_tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a pool however small the work (at this scale the size rule would run every shard here: see the next test)
    monkeypatch.setattr(sh, "POOL_START_S", 0.0)
    pools: list[int] = []
    real_pool = sh._run_in_processes
    monkeypatch.setattr(
        sh, "_run_in_processes", lambda tasks, *a: pools.append(len(tasks)) or real_pool(tasks, *a)
    )
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(200))
    one = package_sft(
        one_source_blend(path), tiny_tokenizer, str(tmp_path / "a"), packaging_settings(workers=1), log=quiet
    )
    two = package_sft(
        one_source_blend(path), tiny_tokenizer, str(tmp_path / "b"), packaging_settings(workers=2), log=quiet
    )
    assert one.num_shards == 5 and one.run_hash == two.run_hash
    assert pools == [4]  # the first shard here (timed), the other four in the pool
    assert _bytes(one.root) == _bytes(two.root)
    again = package_sft(
        one_source_blend(path), tiny_tokenizer, str(tmp_path / "a"), packaging_settings(workers=2), log=quiet
    )
    assert again.report.skipped == [f"{i:06d}" for i in range(5)] and not again.report.processed
    assert _bytes(again.root) == _bytes(one.root)
    # the same bytes through fsspec's memory filesystem
    mem = package_sft(
        one_source_blend(path), tiny_tokenizer, "memory://nexa-pack-test/out", packaging_settings(), log=quiet
    )
    assert mem.run_hash == one.run_hash
    for name in OUTPUTS:
        with storage.open_read(storage.join(mem.root, name)) as f:
            assert f.read() == _bytes(one.root)[name]
    # packed rows are what training reads: pack_size long, boundaries consistent, positions restart per document
    assert check_packed_file(one.paths["train"], 256) == []
    assert _rows(one.paths["train"]) == _rows(two.paths["train"])
    table = read_packed_table(one.paths["train"]).to_pylist()
    for row in table:
        cu = row["cu_seqlens"]
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            assert row["position_ids"][a:b] == list(range(b - a))
    # a changed configuration is a different run
    other = package_sft(
        one_source_blend(path), tiny_tokenizer, str(tmp_path / "a"), packaging_settings(seed=1), log=quiet
    )
    assert other.run_hash != one.run_hash


def test_corrupted_receipt_and_output_are_redone(tiny_tokenizer, tmp_path: Path, monkeypatch) -> None:
    from nexa_dagster.core.common import stat_cache

    monkeypatch.setattr(stat_cache, "RACY_S", 0.0)  # remember checksums at once (a night later, in real life)
    monkeypatch.setenv("NEXA_CACHE_DIR", str(tmp_path / "cache"))
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(120))
    first = package_sft(
        one_source_blend(path), tiny_tokenizer, str(tmp_path / "out"), packaging_settings(), log=quiet
    )
    first = package_sft(
        one_source_blend(path), tiny_tokenizer, str(tmp_path / "out"), packaging_settings(), log=quiet
    )
    assert first.report.skipped and list(Path(tmp_path, "cache", "stat-cache").glob("*.json"))
    time.sleep(0.05)  # the rewrite below lands on a later timestamp tick than the stat that was remembered
    reference = _bytes(first.root)
    store = str(tmp_path / "out" / "store")  # shards live in the content-addressed store, named by their key
    keys = [s["shard_id"] for s in json.loads(Path(first.root, "snapshot.json").read_text())["shards"]]
    Path(sh.receipt_path(store, keys[0])).write_text('{"shard_id": "x", "key": ')  # torn JSON
    out = Path(store, "shards", f"{keys[1]}.train.parquet")
    out.write_bytes(out.read_bytes()[:-10] + b"0123456789")  # same size, other bytes
    receipt = json.loads(Path(sh.receipt_path(store, keys[2])).read_text())
    receipt["key"] = "0" * 32  # a receipt from another plan
    Path(sh.receipt_path(store, keys[2])).write_text(json.dumps(receipt))
    logged: list[str] = []
    again = package_sft(
        one_source_blend(path), tiny_tokenizer, str(tmp_path / "out"), packaging_settings(), log=logged.append
    )
    assert sorted(again.report.redone) == ["000000", "000001", "000002"]
    assert "unreadable receipt" in again.report.redone["000000"]
    assert "does not match its checksum" in again.report.redone["000001"]
    assert "another plan" in again.report.redone["000002"]
    assert any("redoing" in m for m in logged)
    assert _bytes(again.root) == reference


def test_a_remembered_fact_is_dropped_when_the_file_changes(tmp_path: Path, monkeypatch) -> None:
    """Checksums and shard ranges of earlier days are remembered by the file's stat, never for a file written just
    now (its rewrite could keep the same timestamps), never for a remote one, and a rewrite is always seen."""
    from nexa_dagster.core.common import stat_cache

    cache = str(tmp_path / "cache")
    f = tmp_path / "day.jsonl"
    f.write_bytes(b"a" * 100)
    computed: list[str] = []
    real = storage.sha256_file
    monkeypatch.setattr(storage, "sha256_file", lambda p: computed.append(p) or real(p))
    stat_cache.sha256_file(str(f), cache)
    assert not list(Path(cache).glob("*.json"))  # written moments ago: not remembered
    monkeypatch.setattr(stat_cache, "RACY_S", 0.0)
    first = stat_cache.sha256_file(str(f), cache)
    assert stat_cache.sha256_file(str(f), cache) == first and len(computed) == 2  # the second from the cache
    time.sleep(0.05)
    with open(f, "r+b") as handle:  # in place: same inode, same size, other bytes
        handle.write(b"b")
    assert stat_cache.sha256_file(str(f), cache) == real(str(f)) != first and len(computed) == 3
    (tmp_path / "not-a-folder").write_text(
        ""
    )  # a cache that cannot be written costs a re-read, never the run
    assert (
        stat_cache.sha256_file(str(f), str(tmp_path / "not-a-folder")) == real(str(f)) and len(computed) == 4
    )
    computed.pop()
    storage.write_text("x", "memory://nexa-stat-cache/x")
    stat_cache.sha256_file("memory://nexa-stat-cache/x", cache)
    stat_cache.sha256_file("memory://nexa-stat-cache/x", cache)
    assert len(computed) == 5  # a remote file is always read


# -- incremental: a night packs its own day, and the snapshot equals one built from nothing -----------------------


def _day_frame(day: str, n: int, prefix: str) -> pd.DataFrame:
    records = chat_records(n, seed=sum(map(ord, day)))
    return pd.DataFrame(
        {
            "sample_id": [f"{prefix}{i:04d}" for i in range(n)],
            "day": [day] * n,
            "system_prompt": [""] * n,
            "prompt": [r["messages"][0]["content"] for r in records],
            "response": [r["messages"][1]["content"] for r in records],
        }
    )


def _all_train_side(n: int, fraction: float) -> list[str]:
    """Ids whose split hash puts every one of them on the train side: day 1 then needs a split override."""
    ids = [f"d1-{i}" for i in range(200)]
    return [s for s in ids if not is_validation(s, fraction) and not is_held_out(s, 0.1)][:n]


def _new_receipts(root: Path, before: set[Path]) -> list[dict]:
    """The shards packed since ``before`` (a receipt is written for every shard packed, wherever it lives)."""
    return [json.loads(p.read_text()) for p in sorted(root.rglob("receipts/*.json")) if p not in before]


def test_incremental_night_packs_only_its_day_and_equals_a_build_from_nothing(
    tiny_tokenizer, tmp_path: Path
) -> None:
    day1 = _day_frame("2026-11-01", 3, "x")
    day1["sample_id"] = _all_train_side(
        3, 0.2
    )  # alone, day 1 has no validation sample: an override moves one
    days = [day1, _day_frame("2026-11-02", 90, "b"), _day_frame("2026-11-03", 70, "c")]
    kw = {
        "pack_size": 256,
        "validation_fraction": 0.2,
        "rows_per_shard": 40,
        "eval_fraction": 0.1,
        "log": quiet,
    }
    inc = tmp_path / "inc"
    snapshots = []
    for night in range(1, 4):
        before = set(inc.rglob("receipts/*.json"))
        dataset, _ = build_sft_dataset(
            pd.concat(days[:night], ignore_index=True), tiny_tokenizer, "tok", str(inc), **kw
        )
        snapshots.append(dataset)
        packed = _new_receipts(inc, before)
        if (
            night == 3
        ):  # only day 3's rows were read, tokenized and packed (2 shards); days 1-2 came from the store
            assert sum(r["rows"] for r in packed) == 70 and len(packed) == 2
        if night == 2:  # day 1 again: its night-1 shard carried the split override, which no longer applies
            assert sum(r["rows"] for r in packed) == 3 + 90
    assert len({s.run_hash for s in snapshots}) == 3  # each night is its own snapshot, for lineage
    assert all(
        Path(s.train_path).exists() for s in snapshots
    )  # earlier snapshots stay where checkpoints point
    scratch, _ = build_sft_dataset(
        pd.concat(days, ignore_index=True), tiny_tokenizer, "tok", str(tmp_path / "scratch"), **kw
    )
    assert scratch.run_hash == snapshots[-1].run_hash
    assert _bytes(scratch.root) == _bytes(snapshots[-1].root)
    baseline, _ = build_sft_dataset(
        pd.concat(days, ignore_index=True),
        tiny_tokenizer,
        "tok",
        str(tmp_path / "baseline"),
        incremental=False,
        **kw,
    )
    # the rows a training reads: the night-by-night snapshot's shard files, in manifest order, are the rows of the
    # one built from nothing, of the one packed without the store, and of the single concatenated file a snapshot
    # used to be (nothing of days 1-2 is copied into night 3's folder: it holds manifests, no packed rows)
    last = snapshots[-1]
    assert not list(Path(last.root).glob("*.parquet"))
    for split in ("train_path", "validation_path"):
        rows = _rows(getattr(last, split))
        assert rows == _rows(getattr(scratch, split)) == _rows(getattr(baseline, split))
        concatenated = str(tmp_path / f"concatenated-{split}.parquet")
        sh.concat_parquet(split_files(getattr(last, split)), concatenated, PACKED_SCHEMA)
        assert rows == _rows(concatenated) and len(rows["input_ids"]) > 1
    assert check_packed_file(last.train_path, 256) == []
    # the splits are per id and compose with days: no eval-set id trained on, each id on one side only
    ids = {
        split: [
            json.loads(line)["sample_id"] for line in split_lines(getattr(scratch, f"{split}_jsonl_path"))
        ]
        for split in ("train", "validation")
    }
    for split in (
        "train",
        "validation",
    ):  # the JSONL export, read through its manifest, is the same everywhere
        path = f"{split}_jsonl_path"
        assert list(split_lines(getattr(last, path))) == list(split_lines(getattr(baseline, path)))
        assert len(list(split_lines(getattr(last, path)))) == len(ids[split])
    assert not set(ids["train"]) & set(ids["validation"])
    assert not [s for s in ids["train"] + ids["validation"] if is_held_out(s, 0.1)]
    assert scratch.held_out_samples == sum(is_held_out(s, 0.1) for d in days for s in d["sample_id"])


def test_a_sample_id_on_two_days_is_kept_on_the_earliest_day_only(
    tiny_tokenizer, tmp_path: Path, monkeypatch
) -> None:
    """Each day's partition is schema-checked alone, so an id repeated on another day passed both checks and was
    trained on twice; an on-disk index finds it, reading only the new day's ids. The training does not fail on it
    (two days processed at once both keep a repeated document upstream): the earliest day keeps the row, the later
    day is packaged without it, and the count is in the dataset's record, whatever order the days were indexed in.
    An id twice within one day is still an error."""
    from nexa_dagster.core.data import sample_ids

    kw = {"pack_size": 256, "validation_fraction": 0.2, "rows_per_shard": 40, "log": quiet}
    out = str(tmp_path / "sft")
    day1, day2 = _day_frame("2026-11-01", 20, "a"), _day_frame("2026-11-02", 20, "b")
    first, _ = build_sft_dataset(pd.concat([day1, day2], ignore_index=True), tiny_tokenizer, "tok", out, **kw)
    assert first.cross_day_duplicates_dropped == 0
    # day 2 materialized again (other answers, the same ids): it replaces the old version, no clash with it
    day2_again = day2.assign(response=day2["response"] + " again")
    build_sft_dataset(pd.concat([day1, day2_again], ignore_index=True), tiny_tokenizer, "tok", out, **kw)
    day3 = _day_frame("2026-11-03", 20, "c")
    day3.loc[7, "sample_id"] = "a0004"  # day 1's id, with day 3's answer
    read: list[str] = []
    real = sample_ids._ids_of
    monkeypatch.setattr(sample_ids, "_ids_of", lambda path, field: read.append(path) or real(path, field))
    dataset, _ = build_sft_dataset(
        pd.concat([day1, day2_again, day3], ignore_index=True), tiny_tokenizer, "tok", out, **kw
    )
    assert len(read) == 1  # only the new day's ids were read: days 1 and 2 are in the index on disk
    assert Path(out, "inputs", "sample-ids.sqlite").exists()
    assert dataset.cross_day_duplicates_dropped == 1 and dataset.num_samples == 59

    def answers_of(ds, sample_id: str) -> list[str]:
        return [
            record["messages"][-1]["content"]
            for split in ("train", "validation")
            for record in map(json.loads, split_lines(getattr(ds, f"{split}_jsonl_path")))
            if record["sample_id"].split("#")[0] == sample_id
        ]

    assert answers_of(dataset, "a0004") == [day1.loc[4, "response"]]  # once, day 1's row
    # the later day indexed first (it was processed first): the earliest day still keeps the row
    other = str(tmp_path / "sft-other-order")
    build_sft_dataset(day3, tiny_tokenizer, "tok", other, **kw)
    reordered, _ = build_sft_dataset(
        pd.concat([day1, day2_again, day3], ignore_index=True), tiny_tokenizer, "tok", other, **kw
    )
    assert reordered.cross_day_duplicates_dropped == 1 and reordered.run_hash == dataset.run_hash
    assert answers_of(reordered, "a0004") == [day1.loc[4, "response"]]
    # twice within one day (a frame built by hand; a partition's schema check catches it before packaging)
    with pytest.raises(sample_ids.DuplicateSampleId, match=r"'b0001' occurs twice in day 2026-11-04"):
        build_sft_dataset(
            _day_frame("2026-11-04", 5, "b").assign(sample_id=["b0001"] * 5), tiny_tokenizer, "tok", out, **kw
        )


def test_the_store_keeps_the_last_snapshots_shards_and_removes_the_rest(
    tiny_tokenizer, tmp_path: Path
) -> None:
    """keep_snapshots: the newest K snapshots stay readable with every shard they list; older snapshots and the
    shards only they listed are removed, and nothing is removed while a packaging run is in flight."""
    from nexa_dagster.core.packaging.store_cleanup import clean_store, packaging_in_flight
    from nexa_dagster.core.training.data import load_packed

    kw = {
        "pack_size": 256,
        "validation_fraction": 0.2,
        "rows_per_shard": 40,
        "log": quiet,
        "keep_snapshots": 2,
    }
    out = tmp_path / "sft"
    day1, day2, day4 = (
        _day_frame(d, 30, p) for d, p in (("2026-11-01", "a"), ("2026-11-02", "b"), ("2026-11-04", "d"))
    )
    day2_again = day2.assign(response=day2["response"] + " again")  # day 2 materialized again: a new shard
    nights = [[day1], [day1, day2], [day1, day2_again], [day1, day2_again, day4]]
    snapshots = []
    for frames in nights:
        snapshots.append(
            build_sft_dataset(pd.concat(frames, ignore_index=True), tiny_tokenizer, "tok", str(out), **kw)[0]
        )
        time.sleep(0.02)  # manifests written on distinct timestamps: the newest are the last ones
    keys = [
        {s["shard_id"] for s in json.loads(Path(n.root, "snapshot.json").read_text())["shards"]}
        if Path(n.root).exists()
        else None
        for n in snapshots
    ]
    assert keys[:2] == [None, None]  # nights 1 and 2 are older than the last 2: removed
    stored = {p.name.removesuffix(".json") for p in (out / "store" / "receipts").glob("*.json")}
    assert (
        stored == keys[2] | keys[3] and len(stored) == 3
    )  # day 2's first shard went with night 2's snapshot
    assert not [p for p in (out / "store" / "shards").iterdir() if p.name.split(".")[0] not in stored]
    for kept in snapshots[2:]:  # still what training reads
        assert load_packed(kept.train_path)["input_ids"].shape[0] == kept.num_train_sequences
    with packaging_in_flight(str(out)):  # another run between its receipt checks and its manifest
        busy = clean_store(str(out), 1, quiet)
    assert "in flight" in busy.skipped and not busy.removed_shards and Path(snapshots[2].root).exists()
    done = clean_store(str(out), 1, quiet)
    assert done.removed_snapshots == [Path(snapshots[2].root).name] and done.removed_shards == []


def test_streamed_split_overrides_equal_the_in_memory_ones(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for trial in range(30):
        n = int(rng.integers(0, 6))
        ids = [f"t{trial}-{int(i)}" for i in rng.integers(0, 50, size=n)]
        frame = pd.DataFrame(
            {
                "sample_id": ids,
                "day": [f"2026-11-0{1 + i % 3}" for i in range(n)],
                "system_prompt": "",
                "prompt": "q",
                "response": "a",
            }
        )
        inputs = day_inputs_from_frame(frame, str(tmp_path)) if n else []
        trainable = [s for s in ids if not is_held_out(s, 0.2)]
        assert streamed_side_overrides(inputs, 0.3, 0, 0.2) == side_overrides(trainable, 0.3, 0), ids


def test_partitions_are_read_one_file_at_a_time_and_converted_once(tmp_path: Path, monkeypatch) -> None:
    paths = []
    for k, day in enumerate(("2026-11-01", "2026-11-02", "2026-11-03")):
        paths.append((day, str(tmp_path / "assets" / f"{day}.parquet")))
        storage.write_parquet(_day_frame(day, 10 + k, f"p{k}"), paths[-1][1])
    read: list[int] = []
    real = storage.read_parquet
    monkeypatch.setattr(storage, "read_parquet", lambda p: read.append(len(frame := real(p))) or frame)
    first = day_inputs_from_partitions(paths, str(tmp_path / "sft"))
    assert read == [10, 11, 12]  # one partition in memory at a time, never the concatenation
    assert [d.days for d in first] == [("2026-11-01",), ("2026-11-02",), ("2026-11-03",)]
    read.clear()
    again = day_inputs_from_partitions(paths, str(tmp_path / "sft"))
    assert again == first and read == []  # a known partition is not read again: its bytes' hash finds it
    assert day_inputs_from_frame(pd.concat([real(p) for _, p in paths]), str(tmp_path / "sft")) == first


def test_packaging_assets_do_not_load_the_samples_into_the_dagster_process() -> None:
    from nexa_dagster.assets.packaging import pretrain_corpus, rl_prompts, sft_dataset

    for asset, name, table in (
        (sft_dataset, "sft_dataset", "filtered_samples"),
        (rl_prompts, "rl_prompts", "filtered_samples"),
        (pretrain_corpus, "pretrain_corpus", "raw_documents"),
    ):
        spec = asset.get_asset_spec(dg.AssetKey(name))
        assert dg.AssetKey(table) in {d.asset_key for d in spec.deps}
        assert asset.op.ins[table].dagster_type.is_nothing, name  # no DataFrame of every partition


def test_rl_inputs_are_read_one_partition_at_a_time_without_the_eval_side(
    tmp_path: Path, monkeypatch
) -> None:
    paths = []
    for k, day in enumerate(("2026-11-01", "2026-11-02")):
        paths.append((day, str(tmp_path / f"{day}.parquet")))
        storage.write_parquet(_day_frame(day, 40 + k, f"r{k}"), paths[-1][1])
    read: list[int] = []
    real = storage.read_parquet
    monkeypatch.setattr(storage, "read_parquet", lambda p: read.append(len(frame := real(p))) or frame)
    files = partitions_to_flat_jsonl(paths, str(tmp_path / "rl"), eval_fraction=0.3)
    assert read == [40, 41] and len(files) == 2
    ids = [json.loads(line)["sample_id"] for f in files for line in Path(f).read_text().splitlines()]
    held = [s for k in range(2) for s in _day_frame("x", 40 + k, f"r{k}")["sample_id"] if is_held_out(s, 0.3)]
    assert held and not set(held) & set(ids) and len(ids) == 81 - len(held)


KILL_SCRIPT = r"""
import sys, time
from transformers import AutoTokenizer
import nexa_dagster.core.packaging.sft_dataset as sd
from nexa_dagster.core.packaging.blend import BlendSource, DataBlend

real = sd.process_sft_shard
def slow(task):
    receipt = real(task)
    time.sleep(0.4)  # a slow shard, so the test can kill the run between shards and inside one
    return receipt
sd.process_sft_shard = slow
tok = AutoTokenizer.from_pretrained(sys.argv[1])
blend = DataBlend(name="test", sources=[BlendSource(name="chat", path=sys.argv[2])])
sd.package_sft(blend, tok, sys.argv[3], sd.PackagingSettings(256, 0.2, 0, "raise", 40, 1), log=print)
"""


def test_kill_and_resume_gives_the_uninterrupted_bytes(
    tiny_tokenizer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(400))  # 10 shards
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(tiny_model_dir), path, str(out)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    receipts: list[Path] = []
    while time.monotonic() < deadline and proc.poll() is None:
        receipts = list(out.glob("*/receipts/*.json"))
        if len(receipts) >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, (
        f"the run ended before it could be killed: {proc.stdout.read().decode()[-2000:]}"
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(list(out.glob("*/receipts/*.json")))
    assert 3 <= done_before < 10
    assert not list(out.glob("*/train.shards.json"))  # killed before finalize

    resumed = package_sft(
        one_source_blend(path), tiny_tokenizer, str(out), packaging_settings(workers=2), log=quiet
    )
    assert len(resumed.report.skipped) == done_before
    assert len(resumed.report.processed) == 10 - done_before
    assert not list(out.rglob("*.tmp"))
    clean = package_sft(
        one_source_blend(path), tiny_tokenizer, str(tmp_path / "clean"), packaging_settings(), log=quiet
    )
    assert clean.run_hash == resumed.run_hash and _bytes(clean.root) == _bytes(resumed.root)


def test_a_pool_is_started_only_where_the_shards_work_outweighs_its_start(
    tiny_tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the demo's scale (5 shards of 40 chats, tenths of a second in all) two spawned processes would cost more
    than the whole work: every shard runs here. The rule on its own: a pool pays when the rest's estimated seconds
    times (1 - 1/workers) exceed its start."""
    pools: list[int] = []
    monkeypatch.setattr(sh, "_run_in_processes", lambda tasks, *a: pools.append(len(tasks)))
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(200))
    run = package_sft(
        one_source_blend(path), tiny_tokenizer, str(tmp_path / "a"), packaging_settings(workers=2), log=quiet
    )
    assert pools == [] and len(run.report.processed) == 5
    shard = sh.Shard(1, "chat", "x.jsonl", 0, 1, 0, 100, "0" * 64)
    rest = [sh.ShardTask(shard, "root", "key", {}, {}, "")] * 3  # 300 rows to do
    start = sh.POOL_START_S
    # two processes save at most half the rest's seconds: a pool pays beyond twice its start
    assert not sh.pool_pays(1.9 * start / 300, rest, workers=2)
    assert sh.pool_pays(2.1 * start / 300, rest, workers=2)
    # four workers, three shards left: three processes save two thirds, so beyond 1.5 times the start
    assert not sh.pool_pays(1.4 * start / 300, rest, workers=4) and sh.pool_pays(
        1.6 * start / 300, rest, workers=4
    )
    assert not sh.pool_pays(1.0, [], workers=2)  # nothing left


def test_a_clean_up_removes_a_killed_writers_temporary_file_and_not_a_live_ones(tmp_path: Path) -> None:
    """Two trainings packaging at once share the snapshot folder and the shard store: the second one's clean-up
    of killed runs' leftovers removed the first one's file in the middle of its write, and its rename failed."""
    writer = (
        "import sys, time\nfrom nexa_dagster.core.common import storage\n"
        "with storage.atomic_writer(sys.argv[1]) as f:\n"
        "    f.write(b'x'); f.flush(); print('writing', flush=True); sys.stdin.readline()\n"
    )
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", writer, str(tmp_path / name)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name in ("live.parquet", "killed.parquet")
    }
    for proc in procs.values():
        assert proc.stdout.readline() == "writing\n"
    procs["killed.parquet"].kill()
    procs["killed.parquet"].wait()

    assert sh.clean_temporaries(str(tmp_path)) == 1
    assert [p.name.split(".~")[0] for p in tmp_path.glob(".*.tmp")] == [".live.parquet"]
    procs["live.parquet"].communicate("\n", timeout=60)
    assert procs["live.parquet"].returncode == 0 and (tmp_path / "live.parquet").read_bytes() == b"x"
    assert not (tmp_path / "killed.parquet").exists() and not list(tmp_path.glob(".*.tmp"))


# -- blends, efficiency, other formats ---------------------------------------------------------------------------


def test_blend_weights_and_fingerprint(tiny_tokenizer, tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", chat_records(100, seed=1))
    b = write_jsonl(
        tmp_path / "b.jsonl", [{"input": f"q{i}", "output": f"answer {i} " * 5} for i in range(100)]
    )
    blend = DataBlend(
        name="mix",
        sources=[
            BlendSource(name="a", path=a, weight=2.0),
            BlendSource(name="b", path=b, weight=0.5, transform="sft"),
        ],
    )
    run = package_sft(blend, tiny_tokenizer, str(tmp_path / "out"), packaging_settings(), log=quiet)
    docs = sum(s.documents for s in run.stats.values())
    kept_b = sum(BlendSource(name="b", path=b, weight=0.5).copies(f"s{i}", 0) for i in range(100))
    assert docs == 200 + kept_b and 30 < kept_b < 70
    lines = [json.loads(x) for x in split_lines(run.paths["train_jsonl"])]
    assert any(x["sample_id"].endswith("#1") for x in lines)  # the repeated copies of source a
    reweighted = DataBlend(
        name="mix",
        sources=[
            BlendSource(name="a", path=a, weight=1.0),
            BlendSource(name="b", path=b, weight=0.5, transform="sft"),
        ],
    )
    assert reweighted.fingerprint() != blend.fingerprint()
    assert (
        package_sft(
            reweighted, tiny_tokenizer, str(tmp_path / "out"), packaging_settings(), log=quiet
        ).run_hash
        != run.run_hash
    )


def test_shipped_blends_load() -> None:
    for name in ("blends/sft.yaml", "blends/pretrain.yaml", "blends/rl.yaml"):
        blend = DataBlend.load(name)
        assert blend.sources and len(blend.fingerprint()) == 16


def test_packing_efficiency_at_4096_on_the_sample_data(tiny_tokenizer, tmp_path: Path) -> None:
    from nexa_dagster.core.data.ingest import ingest_day

    records = []
    for day_dir in sorted((REPO_ROOT / "sample_data" / "landing").iterdir()):  # make run's days
        for d in ingest_day(day_dir, day_dir.name, max_docs=None, max_chars=4096 * 3).itertuples():
            half = len(d.text) // 2
            records.append(
                {
                    "sample_id": d.doc_id,
                    "messages": [
                        {"role": "user", "content": d.text[:half]},
                        {"role": "assistant", "content": d.text[half:]},
                    ],
                }
            )
    path = write_jsonl(tmp_path / "sample.jsonl", records)
    run = package_sft(
        one_source_blend(path),
        tiny_tokenizer,
        str(tmp_path / "out"),
        packaging_settings(pack_size=4096, validation_fraction=0.0001, rows_per_shard=5000),
        log=quiet,
    )
    stats = run.stats["train"]
    assert stats.documents >= 700
    # every pack but the last is nearly full: the empty slots are less than one pack's worth plus 0.5%
    assert stats.slots - stats.real_tokens < 4096 + 0.005 * stats.slots, stats


def test_pretrain_corpus_bin_idx(tiny_tokenizer, tmp_path: Path) -> None:
    docs = [{"doc_id": f"d{i}", "text": f"document number {i} " * (i + 1), "extra": i} for i in range(50)]
    path = write_jsonl(
        tmp_path / "docs.jsonl", [*docs[:20], json.dumps({"doc_id": "x", "text": 5}), *docs[20:]]
    )
    blend = DataBlend(
        name="pt",
        sources=[BlendSource(name="docs", path=path, transform={"select": ["text"]}, id_field="doc_id")],
    )
    with pytest.raises(RecordError, match=r"docs\.jsonl:21: field 'text'"):
        package_pretrain(
            blend, tiny_tokenizer, str(tmp_path / "pt"), PretrainSettings(rows_per_shard=16), log=quiet
        )
    run = package_pretrain(
        blend,
        tiny_tokenizer,
        str(tmp_path / "pt"),
        PretrainSettings(rows_per_shard=16, workers=2, on_error="quarantine"),
        log=quiet,
    )
    assert run.num_documents == 50 and run.quarantined_rows == 1 and len(run.prefixes) == 4
    got = [seq.tolist() for prefix in run.prefixes for seq in IndexedDataset(prefix)]
    eos = tiny_tokenizer.eos_token_id
    assert got == [tiny_tokenizer.encode(d["text"], add_special_tokens=False) + [eos] for d in docs]
    megatron = json.loads(Path(run.blend_path).read_text())["data_paths"]
    assert megatron[1::2] == run.prefixes and sum(megatron[0::2]) == run.num_tokens


def _documents_day(day: str, n: int, first: int) -> pd.DataFrame:
    texts = [f"document {i} of {day}: " + "words " * (1 + i % 7) for i in range(first, first + n)]
    return pd.DataFrame(
        {
            "doc_id": [f"doc{i:013d}" for i in range(first, first + n)],
            "day": day,
            "source": "t",
            "title": "",
            "text": texts,
            "n_chars": [len(t) for t in texts],
        }
    )


def test_a_pretraining_corpus_night_tokenizes_only_its_day_and_equals_a_build_from_nothing(
    tiny_tokenizer, tmp_path: Path
) -> None:
    """pretrain_corpus reads the raw_documents partitions a day at a time into day files whose shards live in the
    store: the corpus after day 3 tokenizes only day 3 and lists exactly the prefixes a build from nothing lists."""
    from nexa_dagster.core.data.sample_ids import DuplicateSampleId, check_unique_across_days, index_for
    from nexa_dagster.core.packaging.pretrain_corpus import documents_to_jsonl

    parts = []
    for k, (day, n) in enumerate((("2026-11-01", 20), ("2026-11-02", 30), ("2026-11-03", 10))):
        parts.append((day, str(tmp_path / "assets" / f"{day}.parquet")))
        storage.write_parquet(_documents_day(day, n, 100 * k), parts[-1][1])
    blend = DataBlend.load("blends/pretrain.yaml")

    def night(out: Path, days: int):
        inputs = day_inputs_from_partitions(parts[:days], str(out), to_jsonl=documents_to_jsonl)
        check_unique_across_days(
            [(d.path, d.days) for d in inputs], index_for(str(out)), "doc_id", "raw_documents"
        )
        return package_pretrain(
            blend,
            tiny_tokenizer,
            str(out),
            PretrainSettings(rows_per_shard=16),
            assets={"raw_documents": [d.path for d in inputs]},
            log=quiet,
        )

    runs = [night(tmp_path / "inc", n) for n in (1, 2, 3)]
    assert (
        len(runs[2].report.processed) == 1 and len(runs[2].report.skipped) == 2 + 2
    )  # day 3: 10 rows, 1 shard
    scratch = night(tmp_path / "scratch", 3)
    assert scratch.run_hash == runs[2].run_hash and not scratch.report.skipped
    read = [
        [seq.tolist() for prefix in run.prefixes for seq in IndexedDataset(prefix)]
        for run in (runs[2], scratch)
    ]
    eos = tiny_tokenizer.eos_token_id
    texts = [t for _, path in parts for t in pd.read_parquet(path).sort_values("doc_id")["text"]]
    assert read[0] == read[1] == [tiny_tokenizer.encode(t, add_special_tokens=False) + [eos] for t in texts]
    blends = [
        Path(run.blend_path).read_text().replace(str(root), "<root>")
        for run, root in ((runs[2], tmp_path / "inc"), (scratch, tmp_path / "scratch"))
    ]
    assert blends[0] == blends[1]
    # a document on two days is caught like a sample on two days
    storage.write_parquet(
        _documents_day("2026-11-04", 3, 205), str(tmp_path / "assets" / "2026-11-04.parquet")
    )
    parts.append(("2026-11-04", str(tmp_path / "assets" / "2026-11-04.parquet")))
    with pytest.raises(
        DuplicateSampleId, match=r"raw_documents: doc_id 'doc0000000000205' is on day 2026-11-03"
    ):
        night(tmp_path / "inc", 4)


def test_rl_jsonl_through_transforms(tmp_path: Path) -> None:
    rows = [
        {
            "sample_id": f"s{i}",
            "system_prompt": "",
            "prompt": f"q{i}",
            "response": f"a{i}",
            "judge_score": 4.0,
            "day": "2026-11-20",
        }
        for i in range(30)
    ]
    path = write_jsonl(tmp_path / "flat.jsonl", rows)
    blend = DataBlend.load("blends/rl.yaml")
    run = package_jsonl(
        blend,
        str(tmp_path / "rl"),
        "rl_prompts",
        assets={"filtered_samples_flat": path},
        rows_per_shard=8,
        workers=1,
        log=quiet,
    )
    out = [json.loads(x) for x in Path(run.path).read_text().splitlines()]
    assert out[0] == {
        "sample_id": "s0",
        "system_prompt": "",
        "prompt": "q0",
        "reference_answer": "a0",
        "judge_score": 4.0,
    }
    assert len(out) == 30 and run.records == 30
