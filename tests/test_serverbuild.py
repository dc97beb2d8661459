"""harness server build on a stand-in source package (the bindings' name and version, a tiny C
llama-server, a git commit) compiled by the real cmake: the binary and its record cached, a
second call served from the cache, failures leaving nothing behind; and what a serving page
says about the server that served."""

import importlib.metadata
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from harness.core.errors import EXIT_FAILURE, EXIT_USAGE, HarnessError
from harness.engine.serverbuild import BuildError, build_server, built_binary, cached_build

VERSION = importlib.metadata.version("llama-cpp-python")
FAKE_MAIN = r"""
#include <stdio.h>
#include <string.h>
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--version")) {
            puts("version: 9.9 (build 9, commit FAKECOMMIT)"); return 0;
        }
        if (!strcmp(argv[i], "-lv")) {
            puts("0.00.002 I cmn  common_param: system_info: n_threads = 1 | CPU : SSE3 = 1 "
                 "| FAKE = 1 | "); return 1;
        }
    }
    return 2;
}
"""


def fake_source(tmp: Path, main_c: str = FAKE_MAIN) -> tuple[Path, str]:
    """A llama_cpp_python-VERSION.tar.gz whose vendor/llama.cpp builds a llama-server target,
    with its own git commit as the real source package ships one; (archive, commit)."""
    tree = tmp / "src" / f"llama_cpp_python-{VERSION}"
    llama = tree / "vendor" / "llama.cpp"
    llama.mkdir(parents=True)
    (llama / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.14)\nproject(fake C)\n"
        "add_executable(llama-server main.c)\n")
    (llama / "main.c").write_text(main_c)
    git = ["git", "-C", str(llama), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(llama)], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "fake"], check=True)
    commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    archive = tmp / f"llama_cpp_python-{VERSION}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    return archive, commit


def test_a_built_server_is_cached_with_its_record_and_reused(tmp_path):
    archive, commit = fake_source(tmp_path)
    seen = []
    build = build_server(lambda pct, line: seen.append(pct), jobs=1,
                         directory=tmp_path / "servers", source=archive)
    binary = Path(build.binary)
    assert binary.is_file() and binary.parent.parent.name == f"llama-cpp-python-{VERSION}"
    assert subprocess.run([binary, "--version"], capture_output=True).returncode == 0
    assert build.llama_cpp_commit == commit and build.llama_cpp_python == VERSION
    assert "FAKECOMMIT" in build.version_output and "FAKE = 1" in build.system_info
    assert "-DLLAMA_CURL=OFF" in build.cmake_args and not build.cached
    assert None in seen and 100 in seen  # steps named, the compile's percentages passed on
    record = json.loads((binary.parent.parent / "build.json").read_text())
    assert record["source_sha256"] == build.source_sha256 and len(build.source_sha256) == 64
    assert not list(binary.parent.parent.glob("build-*"))  # the work tree is removed

    mtime = binary.stat().st_mtime_ns
    again = build_server(lambda pct, line: None, directory=tmp_path / "servers", source=archive)
    assert again.cached and again.binary == build.binary and binary.stat().st_mtime_ns == mtime
    assert built_binary(tmp_path / "servers") == binary
    assert cached_build(directory=tmp_path / "servers").llama_cpp_commit == commit


def test_a_failed_compile_leaves_nothing_and_says_so_in_one_line(tmp_path):
    archive, _ = fake_source(tmp_path, main_c="int main(void) { return undefined_name; }\n")
    with pytest.raises(BuildError) as err:
        build_server(lambda pct, line: None, jobs=1, directory=tmp_path / "servers",
                     source=archive)
    assert err.value.exit_code == EXIT_FAILURE and "undefined_name" in err.value.render()
    assert "\n" not in err.value.render()
    home = tmp_path / "servers" / f"llama-cpp-python-{VERSION}"
    assert not (home / "build.json").exists() and not (home / "bin").exists()
    assert not list(home.glob("build-*"))
    assert cached_build(directory=tmp_path / "servers") is None


def test_a_source_of_another_version_is_refused_before_anything_is_written(tmp_path):
    other = tmp_path / "llama_cpp_python-0.0.1.tar.gz"
    other.write_bytes(b"")
    with pytest.raises(HarnessError) as err:
        build_server(lambda pct, line: None, directory=tmp_path / "servers", source=other)
    assert err.value.exit_code == EXIT_USAGE and VERSION in err.value.render()
    assert not (tmp_path / "servers").exists()


def test_serving_with_no_server_built_names_the_command(tmp_path, run_cli, monkeypatch):
    monkeypatch.setenv("HARNESS_SERVER_DIR", str(tmp_path / "none"))
    with pytest.raises(HarnessError) as err:
        built_binary()
    assert "harness server build" in err.value.render()
    res = run_cli("server", "build", "--source", str(tmp_path / "nope.tar.gz"))
    assert res.exit_code == EXIT_USAGE and "--source" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_the_cli_builds_and_prints_the_binary(tmp_path, run_cli):
    archive, commit = fake_source(tmp_path)
    res = run_cli("server", "build", "--dir", str(tmp_path / "s"), "--source", str(archive),
                  "-j", "1")
    assert res.exit_code == 0, res.stderr
    assert Path(res.stdout.strip()).is_file() and commit[:9] in res.stderr


def test_the_page_names_the_server_that_served():
    from harness.report.serving import server_identity

    build = {"llama_cpp_python": "0.3.36", "llama_cpp_commit": "0c1e57098abc"}
    ours = {"server": {"server": "/x/llama-server", "slots": 4, "build": build},
            "system_info": {"inprocess_commit": "0c1e570-dirty"}}
    assert "the bindings' own commit" in server_identity(ours)
    theirs = ours | {"system_info": {"inprocess_commit": "1234567"}}
    assert "the bindings report 1234567" in server_identity(theirs)
    wheel = {"server": {"server": "xllamacpp", "slots": 1, "server_version": "xllamacpp 1.0"}}
    assert "not the bindings'" in server_identity(wheel)
    given = {"server": {"server": "/opt/llama-server", "slots": 1,
                        "server_version": "version: 1 (build 1, commit abc)"}}
    assert "/opt/llama-server" in server_identity(given) and "abc" in server_identity(given)
    assert "http://h:1" in server_identity({"server": {"endpoint": "http://h:1"}})


def test_busy_slots_per_decode_call_are_taken_apart_per_level():
    from harness.serving import counter_deltas

    # the gauge is a running mean since start: 100 calls at 1.0 busy, then 50 more at 4.0
    before = {"llamacpp:n_decode_total": 100, "llamacpp:n_busy_slots_per_decode": 1.0,
              "llamacpp:tokens_predicted_total": 90}
    after = {"llamacpp:n_decode_total": 150, "llamacpp:n_busy_slots_per_decode": 300 / 150,
             "llamacpp:tokens_predicted_total": 270}
    out = counter_deltas(before, after)
    assert out["busy_slots_per_decode_call"] == pytest.approx(4.0)
    assert out["tokens_per_decode_call"] == pytest.approx(180 / 50)
