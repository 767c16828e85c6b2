"""Bad input, generated: the ingest reader and the packaging transforms against what hypothesis can invent.

Every case must end as a result or as a clear error (IngestError / RecordError naming the file and line, or a
quarantined row with its reason): never an unhandled traceback, never a silently lost document. The number of
cases tried is printed (pytest -s) and checked.
"""

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nexa_dagster.core.common.jsonl import BadRow, RecordError, iter_jsonl
from nexa_dagster.core.data.ingest import IngestError, ingest_day, normalise_text, stable_doc_id
from nexa_dagster.core.packaging.transforms import apply_transform, build_transform

CASES = 150
tried = {"ingest": 0, "transforms": 0}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
good_doc = st.fixed_dictionaries(
    {"text": st.text(min_size=0, max_size=300)}, optional={"title": st.text(max_size=20) | st.none()}
)
line = st.one_of(
    good_doc.map(lambda d: json.dumps(d).encode()),  # a valid document
    st.just(b""),  # blank line
    st.binary(max_size=40),  # bytes, maybe not UTF-8
    st.text(max_size=40).map(str.encode),  # text, maybe not JSON
    json_values.map(lambda v: json.dumps(v).encode()),  # JSON of any shape
    st.fixed_dictionaries({"text": json_values}).map(lambda d: json.dumps(d).encode()),  # wrong type for text
    st.integers(100_000, 300_000).map(lambda n: json.dumps({"text": "x" * n}).encode()),  # enormous row
)


@settings(
    max_examples=CASES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(lines=st.lists(line, max_size=12), duplicate=st.booleans())
def test_ingest_ends_in_documents_or_an_error_naming_the_line(lines: list[bytes], duplicate: bool) -> None:
    tried["ingest"] += 1
    if duplicate and lines:
        lines = lines + [lines[0]]  # duplicate ids: kept once
    with tempfile.TemporaryDirectory() as tmp:
        day = Path(tmp) / "2026-11-20"
        day.mkdir()
        path = day / "docs.jsonl"
        path.write_bytes(b"\n".join(x.replace(b"\n", b" ") for x in lines))
        expected, first_bad = [], None
        for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
            try:
                text = raw.decode("utf-8").strip()
                if not text:
                    continue  # blank lines are skipped
                record = json.loads(text)
            except (UnicodeDecodeError, json.JSONDecodeError):
                first_bad = first_bad or number
                continue
            if not isinstance(record, dict):
                first_bad = first_bad or number
                continue
            value = _first(record, ("text", "content", "body"))
            title = _first(record, ("title", "name", "topic"))
            if not isinstance(value, str) or not isinstance(title, (str, type(None))):
                first_bad = first_bad or number
                continue
            expected.append(value)
        try:
            frame = ingest_day(day, "2026-11-20", max_docs=None, max_chars=1_000_000)
        except IngestError as e:
            message = str(e)
            assert (
                str(path) in message
                or "no documents landed" in message
                or "no non-empty documents" in message
            )
            if first_bad is not None:
                assert f"{path}:{first_bad}:" in message, (message, first_bad)
            return
        assert first_bad is None, f"line {first_bad} is bad but ingest accepted the file"
        kept = {stable_doc_id(normalise_text(t)) for t in expected if normalise_text(t)}
        assert set(frame["doc_id"]) == kept, "a document was lost or invented"
        assert frame["doc_id"].is_unique


def _first(record: dict, names: tuple[str, ...]) -> object:
    """The reader's rule: the first of the candidate fields that is present and not null."""
    return next((record[n] for n in names if record.get(n) is not None), None)


records = st.dictionaries(
    st.sampled_from(["input", "output", "system", "messages", "conversations", "id", "x"]),
    json_values
    | st.lists(
        st.dictionaries(
            st.sampled_from(["role", "content", "from", "value"]),
            st.text(max_size=12) | st.sampled_from(["user", "assistant", "system", "human", "gpt"]),
            max_size=3,
        ),
        max_size=4,
    ),
    max_size=5,
)
specs = st.sampled_from(
    [
        "sft",
        "openai_chat",
        "sharegpt",
        "passthrough",
        {"select": ["id", "x"]},
        {"rename": {"x": "y"}},
        ["passthrough", {"select": ["input", "output"]}, "sft"],
    ]
)


@settings(max_examples=CASES, deadline=None, derandomize=True)
@given(record=records, spec=specs, raw_junk=st.binary(max_size=30))
def test_transforms_end_in_a_record_or_a_quarantined_row_with_a_reason(
    record: dict, spec: object, raw_junk: bytes
) -> None:
    tried["transforms"] += 1
    transform = build_transform(spec)
    out = apply_transform(transform, record, "chat.jsonl:7", on_error="quarantine")
    if isinstance(out, BadRow):
        assert out.where == "chat.jsonl:7" and out.reason
    else:
        assert isinstance(out, dict)
    try:
        apply_transform(transform, record, "chat.jsonl:7", on_error="raise")
    except RecordError as e:
        assert "chat.jsonl:7" in str(e)
    # the same record arriving as a raw line, possibly with junk bytes after it
    import io

    rows = list(
        iter_jsonl(
            io.BytesIO(json.dumps(record).encode() + b"\n" + raw_junk + b"\n"),
            "chat.jsonl",
            on_error="quarantine",
        )
    )
    assert isinstance(rows[0][1], dict)
    assert all(isinstance(r, dict) or (isinstance(r, BadRow) and r.reason) for _, r in rows)


def test_report_how_many_cases_were_tried() -> None:
    """Hypothesis stops early when it runs out of distinct cases: run both properties here (about 2 s), so the
    count holds whichever xdist worker ran them above, or when this test runs alone."""
    tried.update(ingest=0, transforms=0)
    test_ingest_ends_in_documents_or_an_error_naming_the_line()
    test_transforms_end_in_a_record_or_a_quarantined_row_with_a_reason()
    print(f"fuzz cases tried: ingest {tried['ingest']}, transforms {tried['transforms']}")
    assert tried["ingest"] >= CASES and tried["transforms"] >= CASES
