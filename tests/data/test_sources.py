"""Reading rows (data/sources.py): every file type loads; a malformed line, a duplicated column, a header-only CSV,
an empty or unreadable file and a split's typo are each one line naming the file, the row and the column (or the
split meant); a hub data set without network says how to pass a file."""

from __future__ import annotations

import pytest

import run_finetuning
from data.sources import DataError
from tests.helpers import SMALL, fails, write_jsonl
from tests.mnli import load_rows


@pytest.mark.parametrize("suffix", ["csv", "parquet", "json"])
def test_other_file_types_load(tmp_path, suffix):
    import pandas as pd

    df = pd.DataFrame({"premise": ["the cat runs ."], "hypothesis": ["the cat runs ."], "label": [0]})
    path = str(tmp_path / f"validation_mismatched.{suffix}")
    {"csv": lambda: df.to_csv(path, index=False), "parquet": lambda: df.to_parquet(path),
     "json": lambda: df.to_json(path, orient="records")}[suffix]()
    assert load_rows(str(tmp_path), "validation_mismatched") == [
        {"premise": "the cat runs .", "hypothesis": "the cat runs .", "label": 0}]


@pytest.mark.parametrize("rows,message", [
    ([{"premise": "a", "label": 0}], r"row 0 \(line 1\): column 'hypothesis' is missing"),
    ([{"premise": "a", "hypothesis": "b", "label": 0}, {"premise": [3], "hypothesis": "b", "label": 0}],
     r"row 1 \(line 2\): column 'premise' must be text, got \[3\] \(list\)"),
    ([{"premise": True, "hypothesis": "b", "label": 0}], r"row 0 \(line 1\): column 'premise' must be text"),
    ([{"premise": "a", "hypothesis": "b", "label": "yes"}], r"row 0 \(line 1\): column 'label' must be 0, 1, 2"),
    ([{"premise": "a", "hypothesis": "b", "label": 7}], r"row 0 \(line 1\): column 'label' must be 0, 1, 2"),
])
def test_malformed_rows_name_file_row_and_column(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError, match=message) as e:
        load_rows(path, "train")
    assert path in str(e.value)


def test_empty_and_unreadable_files(tmp_path):
    empty = tmp_path / "train.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="train.jsonl"):
        load_rows(str(empty), "train")
    bad = tmp_path / "x.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DataError, match="cannot be read"):
        load_rows(str(bad), "train")
    with pytest.raises(DataError, match="has no validation_mismatched"):
        load_rows(str(tmp_path / ".."), "validation_mismatched")


def test_hub_dataset_without_network_says_how_to_pass_a_file(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="--dataset PATH"):
        load_rows("glue/mnli", "validation_mismatched")


def test_malformed_lines_duplicated_columns_and_split_typos_are_named(tmp_path, capsys):
    from data.sources import DataError
    from tests.mnli import load_rows

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"premise": "a", "hypothesis": "b", "label": 0}\n{"premise": "a", "hypothesis": \n')
    with pytest.raises(DataError, match=r"bad.jsonl: line 2: not a valid JSON object"):
        load_rows(str(bad), "train")
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"premise": "a", "hypothesis": "b", "label": 0, "label": 2}\n')
    with pytest.raises(DataError, match=r"line 1: .*label appear more than once"):
        load_rows(str(dup), "train")
    csv = tmp_path / "dup.csv"
    csv.write_text("premise,hypothesis,label,label\na,b,0,2\n")
    with pytest.raises(DataError, match=r"line 1: column\(s\) label appear more than once"):
        load_rows(str(csv), "train")
    with pytest.raises(DataError, match=r"did you mean validation_mismatched"):
        load_rows("synthetic", "validaton_mismatched")
    fails(capsys, run_finetuning.main, SMALL + ["--steps", "1", "--sequence_length", "4"], "prompt template")


# ---------------------------------------------------------------------- 9, 12. a header-only CSV, a null target
def test_a_header_only_csv_and_a_null_target_are_named_as_what_they_are(tmp_path):
    from data import sources
    from data.sources import DataError
    from data.tasks import Task
    from types import SimpleNamespace

    header = tmp_path / "rows.csv"
    header.write_text("question,answer\n")
    with pytest.raises(DataError, match=r"rows.csv: the file has no rows \(a header alone\): give a file"):
        sources.read(str(header), "train")
    task = Task(SimpleNamespace(name="qa", input_template=None, input_column="question", target_column="answer",
                                labels=None, metrics=("exact_match",)))
    null = tmp_path / "null.jsonl"
    null.write_text('{"question": "a", "answer": "b"}\n{"question": "c", "answer": null}\n')
    with pytest.raises(DataError, match=r"null.jsonl: row 1 \(line 2\): column 'answer' is null: give the answer"):
        task.examples(sources.read(str(null), "train"))
    absent = tmp_path / "absent.jsonl"
    absent.write_text('{"question": "a", "answer": "b"}\n{"question": "c"}\n')
    with pytest.raises(DataError, match=r"row 1 \(line 2\): column 'answer' is missing: .* the row has question"):
        task.examples(sources.read(str(absent), "train"))
    parquet = tmp_path / "null.parquet"
    import pandas as pd

    pd.DataFrame([{"question": "a", "answer": "b"}, {"question": "c", "answer": None}]).to_parquet(parquet)
    with pytest.raises(DataError, match=r"row 1: column 'answer' is null \(or absent from this row\)"):
        task.examples(sources.read(str(parquet), "train"))


def test_a_csv_with_a_utf8_byte_order_mark_is_read_and_one_not_in_utf8_is_one_line_naming_its_line(tmp_path):
    """Excel's "CSV UTF-8" starts with a byte-order mark: read, its first column named without it (it was refused
    with a KeyError on the first field); a Latin-1 file is one line naming the first line that is not UTF-8 and the
    fix (it was a 43-line traceback), in the header, early, or past the first block read."""
    from data.sources import read

    body = "premise,hypothesis,label\nthe cat sleeps .,the cat sleeps .,entailment\n"
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + body.encode())
    rows = read(str(tmp_path / "bom.csv"), "train").rows
    assert rows.column_names == ["premise", "hypothesis", "label"] and rows[0]["premise"] == "the cat sleeps ."
    many = "".join(f"the cat {i} .,a .,neutral\n" for i in range(2000))
    for name, data, line in (("head.csv", "prémise,b,c\na,b,c\n", 1), ("early.csv", body + "the café .,a .,c\n", 3),
                             ("late.csv", body + many + "the café .,a .,c\n", 2003)):
        (tmp_path / name).write_bytes(data.encode("latin-1"))
        with pytest.raises(DataError) as e:
            read(str(tmp_path / name), "train")
        message = str(e.value)
        assert message.startswith(f"{tmp_path / name}: line {line} is not UTF-8 (byte 0xe9") and "\n" not in message
        assert "save it as UTF-8" in message
