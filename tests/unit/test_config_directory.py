"""`load_config(DIRECTORY)`: llama-swap's `-config-dir` merge, case by case as
its internal/config/merge_test.go has them."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import ConfigError, load_config


def model(name: str, cmd: str) -> str:
    return f"  {name}:\n    cmd: {cmd}\n    proxy: http://localhost:9999\n"


def write(directory: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def errors(directory: Path) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(directory)
    return err.value.errors


def test_the_files_merge_in_name_order(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "z.yaml": "models:\n" + model("zmodel", "echo z") + "apiKeys: [key-z]\n",
            "a.yml": "models:\n" + model("amodel", "echo a") + "apiKeys: [key-a]\n",
            "notes.txt": "not: [yaml",
        },
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("models:\n" + model("nested", "echo n"))
    config = load_config(tmp_path)
    assert list(config.models) == ["amodel", "zmodel"]  # subdirectories are not read
    # Lists concatenate, in file order.
    assert [k.key for k in config.api_keys] == ["key-a", "key-z"]
    assert config.source == str(tmp_path)


def test_macros_of_one_file_serve_another(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "macros.yaml": "macros:\n  SHARED: hello\nmodels:\n" + model("dummy", "echo d"),
            "use.yaml": "macros:\n  LOW: 1\nmodels:\n" + model("user", "echo ${SHARED} ${LOW}"),
        },
    )
    assert load_config(tmp_path).models["user"].cmd == ("echo", "hello", "1")


def test_equal_scalars_agree_and_null_yields(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "a.yaml": "globalTTL: 100\nrouting:\nmodels:\n" + model("m1", "echo m1"),
            "b.yaml": "globalTTL: 100\nmodels:\n"
            + model("m2", "echo m2")
            + "groups:\n  g1: {members: [m1, m2]}\n",
        },
    )
    config = load_config(tmp_path)
    assert config.models["m1"].ttl == 100 and set(config.models) == {"m1", "m2"}


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (
            {"a.yaml": "models:\n" + model("m1", "a"), "b.yaml": "models:\n" + model("m1", "a")},
            "models.m1: duplicate models 'm1' found in {d}/b.yaml",
        ),
        (
            {
                "a.yaml": "models:\n" + model("m1", "a") + "groups:\n  g: {members: [m1]}\n",
                "b.yaml": "groups:\n  g: {members: [m1]}\n",
            },
            "groups.g: duplicate groups 'g' found in {d}/b.yaml",
        ),
        (
            {
                "a.yaml": "models:\n" + model("m1", "a") + "healthCheckTimeout: 10\n",
                "b.yaml": "healthCheckTimeout: 20\n",
            },
            "healthCheckTimeout: conflict: {d}/b.yaml sets 20, a previous file 10",
        ),
        (
            {
                "a.yaml": "models:\n" + model("m1", "a") + "startPort: 5800\n",
                "b.yaml": "startPort: [5800]\n",
            },
            "startPort: conflict: {d}/b.yaml gives a list where a previous file gives an integer",
        ),
        (
            {"a.yaml": "models:\n" + model("m1", "a"), "b.yaml": "models:\n"},
            "models: conflict: expected a mapping, introduced by {d}/b.yaml",
        ),
    ],
)
def test_conflicts_name_the_key_and_the_file(
    tmp_path: Path, files: dict[str, str], message: str
) -> None:
    write(tmp_path, files)
    assert [e for e in errors(tmp_path) if e.startswith(message.format(d=tmp_path))], errors(
        tmp_path
    )


def test_an_empty_directory_is_refused_and_empty_files_add_nothing(tmp_path: Path) -> None:
    assert errors(tmp_path) == [f"{tmp_path}: no configuration files (*.yml, *.yaml) found"]
    write(tmp_path, {"empty.yaml": "# nothing yet\n", "m.yaml": "models:\n" + model("m", "a")})
    assert list(load_config(tmp_path).models) == ["m"]


def test_a_bad_file_is_named(tmp_path: Path) -> None:
    write(tmp_path, {"a.yaml": "models:\n" + model("m", "a"), "b.yaml": "- a list\n"})
    assert errors(tmp_path) == [
        f"{tmp_path}/b.yaml: expected a mapping at the top level, got a list"
    ]
