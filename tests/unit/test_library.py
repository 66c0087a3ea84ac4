"""The host's model library: only Ready models count, every skip has a reason, schema in sync."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from supervisor.errors import Transient
from supervisor.library.models import (
    MODEL_STATES,
    Library,
    LibraryModel,
    LibraryUnavailable,
    Skipped,
    library_schema,
    parse_model_json,
    scan,
)
from tests.gguf_fixtures import add_model, new_guid, write_gguf, write_mmproj

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "schemas" / "library-model.schema.json"


def reasons(library: Library) -> dict[str, str]:
    return {s.where: s.reason for s in library.skipped}


# --- the schema ---------------------------------------------------------------------------------


def test_checked_in_schema_matches_the_model() -> None:
    text = SCHEMA.read_text()
    assert json.loads(text) == library_schema(), "schemas/library-model.schema.json drifted"
    assert text == json.dumps(library_schema(), indent=2) + "\n", "not in the generated form"
    jsonschema.Draft202012Validator.check_schema(json.loads(text))


@pytest.mark.parametrize(
    "document",
    [
        {"state": "Ready"},
        {"state": "Ready", "files": None},
        {"state": "Downloading", "files": [{"name": "a.gguf", "sha256": "00"}], "progress": 0.5},
        {"state": "Ready", "files": [], "id": "x", "nested": {"anything": [1, 2]}},
    ],
)
def test_documents_the_model_accepts_match_the_schema(document: dict[str, Any]) -> None:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    validator.validate(document)
    LibraryModel.model_validate(document)


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ({}, "missing field 'state'"),
        ({"state": "ready"}, "state: Input should be 'Queued', 'Downloading', 'Ready', 'Failed', "),
        ({"state": "Ready", "files": [{"name": "../x.gguf"}]}, "files.0.name: String should match"),
        ({"state": "Ready", "files": [{"name": "a/b.gguf"}]}, "files.0.name: String should match"),
        ({"state": "Ready", "files": [{"name": ""}]}, "files.0.name: String should have at least"),
        ({"state": "Ready", "files": [{"size": 3}]}, "missing field 'files.0.name'"),
        ({"state": "Ready", "files": "a.gguf"}, "files: Input should be a valid array"),
    ],
)
def test_documents_the_model_refuses_are_refused_by_the_schema_too(
    document: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValueError, match="^" + problem.replace("(", r"\(").replace(".", r"\.")):
        parse_model_json(json.dumps(document))
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    assert not validator.is_valid(document)


def test_dot_names_are_refused() -> None:
    for name in (".", ".."):
        with pytest.raises(ValueError, match="is not a file name"):
            parse_model_json(json.dumps({"state": "Ready", "files": [{"name": name}]}))


def test_bad_json_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"^not valid JSON: ") as caught:
        parse_model_json('{"state": "Ready",')
    assert "\n" not in str(caught.value)


# --- scan ---------------------------------------------------------------------------------------


def test_ready_models_with_listed_and_with_scanned_files(tmp_path: Path) -> None:
    listed = add_model(tmp_path, listed=["b.gguf", "mmproj-F16.gguf", "README.md", "b.gguf"])
    write_gguf(listed / "b.gguf")
    write_mmproj(listed / "mmproj-F16.gguf")
    write_gguf(listed / "unlisted.gguf")  # model.json lists files: only those count
    scanned = add_model(tmp_path)
    write_gguf(scanned / "z.gguf")
    write_gguf(scanned / "a.gguf")
    (scanned / "notes.txt").write_text("not a model")
    (scanned / ".partial.gguf").write_text("a download in progress, hidden")

    library = scan(tmp_path)
    assert library.skipped == ()
    by_guid = {m.guid: m for m in library.models}
    assert [p.name for p in by_guid[listed.parent.name].files] == ["b.gguf", "mmproj-F16.gguf"]
    assert [p.name for p in by_guid[scanned.parent.name].files] == ["a.gguf", "z.gguf"]
    assert all(p.is_absolute() or p.parent == listed for p in by_guid[listed.parent.name].files)
    assert [m.guid for m in library.models] == sorted(by_guid)


@pytest.mark.parametrize("state", [s for s in MODEL_STATES if s != "Ready"])
def test_every_other_state_is_skipped_with_its_name(tmp_path: Path, state: str) -> None:
    files = add_model(tmp_path, state)
    write_gguf(files / "m.gguf")
    library = scan(tmp_path)
    assert library.models == ()
    assert library.skipped == (Skipped(files.parent.name, f"{state}, not Ready"),)


def test_broken_entries_are_skipped_with_reasons(tmp_path: Path) -> None:
    def model(state: str = "Ready", **kwargs: Any) -> Path:
        return add_model(tmp_path, state, **kwargs)

    bad_json = model()
    (bad_json.parent / "model.json").write_text("{nope")
    no_json = model()
    (no_json.parent / "model.json").unlink()
    unknown_state = model("Verifying")
    no_files_dir = model()
    no_files_dir.rmdir()
    files_is_file = model()
    files_is_file.rmdir()
    files_is_file.write_text("")
    files_is_link = model()
    files_is_link.rmdir()
    files_is_link.symlink_to(tmp_path)
    empty = model()
    missing_listed = model(listed=["gone.gguf", "here.gguf"])
    write_gguf(missing_listed / "here.gguf")
    linked = model()
    write_gguf(tmp_path / "elsewhere.gguf")
    (linked / "link.gguf").symlink_to(tmp_path / "elsewhere.gguf")
    json_link = model()
    (json_link.parent / "model.json").unlink()
    (json_link.parent / "model.json").symlink_to(bad_json.parent / "model.json")
    (tmp_path / "not-a-guid").mkdir()
    (tmp_path / ".trash").mkdir()  # hidden: not reported
    (tmp_path / new_guid()).write_text("a file, not a directory")

    library = scan(tmp_path)
    got = reasons(library)

    def g(files: Path) -> str:
        return files.parent.name

    assert got[g(bad_json)].startswith("model.json: not valid JSON: ")
    assert got[g(no_json)] == "no model.json"
    assert got[g(unknown_state)].startswith("model.json: state: Input should be 'Queued'")
    assert got[g(no_files_dir)] == "files/ cannot be read: No such file or directory"
    assert got[g(files_is_file)] == "files is not a directory"
    assert got[g(files_is_link)] == "files is not a directory"
    assert got[g(empty)] == "Ready but has no .gguf files in files/"
    assert got[f"{g(missing_listed)}/files/gone.gguf"] == (
        "listed in model.json but no such file or directory"
    )
    assert got[f"{g(linked)}/files/link.gguf"] == "not a regular file (symlinks are not followed)"
    assert got[g(json_link)] == "model.json is a symlink; write the file itself"
    assert got["not-a-guid"] == "not a model directory (a 32-hex-digit GUID)"
    assert ".trash" not in got
    assert [m.guid for m in library.models] == [g(missing_listed)]
    assert [p.name for p in library.models[0].files] == ["here.gguf"]
    assert all("\n" not in str(s) for s in library.skipped)


def test_a_missing_library_is_transient_not_an_empty_library(tmp_path: Path) -> None:
    # An empty answer would make the cache remove every model while a share is unmounted.
    with pytest.raises(LibraryUnavailable, match=r"model library .* cannot be read") as caught:
        scan(tmp_path / "unmounted")
    assert isinstance(caught.value, Transient)


def test_model_json_is_read_bounded(tmp_path: Path) -> None:
    files = add_model(tmp_path)
    (files.parent / "model.json").write_text(json.dumps({"state": "Ready", "pad": "x" * 70_000}))
    assert reasons(scan(tmp_path))[files.parent.name].startswith("model.json is ")
    os.truncate(files.parent / "model.json", 0)
    assert reasons(scan(tmp_path))[files.parent.name].startswith("model.json: not valid JSON")
