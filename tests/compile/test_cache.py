"""The compile cache: fingerprints, and entries at a directory and at a real S3 endpoint on
loopback (moto's server through s3fs, as s3fs's own tests do)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from frugality.compile.cache import CompileCache, CompileCacheWarning, entry_name, fingerprint
from frugality.compile.session import CompileSession
from frugality.config.recipe import load_recipe
from frugality.precision import resolve_policy


def _fp(**changes) -> dict:
    args = dict(
        model={"family": "gpt-neox", "hidden_size": 32},
        micro_batch_size=2,
        seq_len=32,
        precision="fp32",
        level="O1",
        device=torch.device("cpu"),
        options={},
    )
    return fingerprint(**(args | changes))


def _key(recipe) -> str:
    cpu = torch.device("cpu")
    session = CompileSession.for_recipe(recipe, cpu, resolve_policy(recipe.train.precision, cpu)[0])
    return session.cache.name


def test_fingerprint_keys_what_changes_graphs_and_nothing_else(micro_recipe_file):
    base = load_recipe(str(micro_recipe_file), ["compile.level=O1"])
    same = [
        ["train.steps=3"],
        ["optim.lr=5e-3"],
        ["train.eval_samples=1"],
        ['compile.cache="/elsewhere"'],
        ["data.global_batch_size=8"],
        ["name=other"],
    ]
    other = [
        ["data.micro_batch_size=4", "data.global_batch_size=4"],
        ["data.seq_len=16"],
        ["model.hidden_size=64"],
        ["train.precision=bf16-sr"],
        ["compile.level=O2"],
    ]
    for extra in same:
        assert _key(load_recipe(str(micro_recipe_file), ["compile.level=O1", *extra])) == _key(base), extra
    for extra in other:
        assert _key(load_recipe(str(micro_recipe_file), ["compile.level=O1", *extra])) != _key(base), extra
    assert entry_name(_fp()).startswith("gpt-neox-O1-fp32-")
    assert entry_name(_fp()) != entry_name(_fp(options={"cpp.max_horizontal_fusion_size": 1}))


def _inductor_like_dir(root):
    (root / "fxgraph" / "ab").mkdir(parents=True)
    (root / "fxgraph" / "ab" / "entry").write_bytes(os.urandom(1000))
    (root / "cd").mkdir()
    (root / "cd" / "kernel.so").write_bytes(b"\x7fELF" + os.urandom(5000))
    (root / "locks").mkdir()
    (root / "locks" / "x.lock").write_text("")
    return {"fxgraph/ab/entry", "cd/kernel.so"}


def _files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _round_trip(url, tmp_path):
    source = tmp_path / "compiled"
    expected = _inductor_like_dir(source)
    cache = CompileCache(url, _fp())
    assert not cache.fetch(tmp_path / "empty").found  # nothing published yet: a plain miss
    archive = cache.publish(source)
    assert archive is not None
    fetched = CompileCache(url, _fp()).fetch(tmp_path / "fresh")
    assert fetched.found and fetched.files == len(expected)
    got = _files(tmp_path / "fresh")
    assert set(got) == expected  # lock files stay behind
    assert all(got[name] == (source / name).read_bytes() for name in expected)
    return cache


def test_round_trip_through_a_directory(tmp_path):
    cache = _round_trip(str(tmp_path / "shared"), tmp_path)
    listing = sorted(p.name for p in (tmp_path / "shared" / cache.name).iterdir())
    assert listing[-1] == "manifest.json" and listing[0].startswith("inductor-")
    assert len(listing) == 2  # the staged manifest was renamed into place


def test_republishing_replaces_the_archive(tmp_path):
    cache = _round_trip(f"file://{tmp_path / 'shared'}", tmp_path)
    (tmp_path / "compiled" / "cd" / "more.so").write_bytes(b"new")
    cache.publish(tmp_path / "compiled")
    entry = tmp_path / "shared" / cache.name
    assert len([p for p in entry.iterdir() if p.name.startswith("inductor-")]) == 1
    assert CompileCache(str(tmp_path / "shared"), _fp()).fetch(tmp_path / "again").files == 3


def test_corrupt_foreign_and_half_written_entries_are_ignored_with_a_warning(tmp_path):
    url = str(tmp_path / "shared")
    cache = _round_trip(url, tmp_path)
    entry = tmp_path / "shared" / cache.name
    manifest = json.loads((entry / "manifest.json").read_text())

    archive = entry / manifest["archive"]
    good = archive.read_bytes()
    archive.write_bytes(good[:-10] + b"0123456789")  # same size, other bytes
    with pytest.warns(CompileCacheWarning, match="does not match its manifest"):
        assert not CompileCache(url, _fp()).fetch(tmp_path / "a").found
    archive.write_bytes(good)

    foreign = manifest | {"fingerprint": _fp(precision="bf16-sr")}
    (entry / "manifest.json").write_text(json.dumps(foreign))
    with pytest.warns(CompileCacheWarning, match="another configuration"):
        assert not CompileCache(url, _fp()).fetch(tmp_path / "b").found

    (entry / "manifest.json").write_text('{"archive": "inductor-')
    with pytest.warns(CompileCacheWarning, match="unreadable manifest"):
        assert not CompileCache(url, _fp()).fetch(tmp_path / "c").found

    (entry / "manifest.json").unlink()  # an archive without a manifest: an upload in flight
    assert not CompileCache(url, _fp()).fetch(tmp_path / "d").found
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


@pytest.fixture
def s3_url(s3_bucket):
    return f"{s3_bucket}/compiled"


def test_round_trip_through_s3(s3_url, tmp_path):
    cache = _round_trip(s3_url, tmp_path)
    names = sorted(name.rsplit("/", 1)[-1] for name in cache.fs.ls(cache.entry, refresh=True))
    assert names[-1] == "manifest.json" and len(names) == 2


def test_corrupt_entry_on_s3_is_ignored_with_a_warning(s3_url, tmp_path):
    cache = _round_trip(s3_url, tmp_path)
    manifest = json.loads(cache.fs.cat_file(f"{cache.entry}/manifest.json"))
    cache.fs.pipe_file(f"{cache.entry}/{manifest['archive']}", b"truncated")
    with pytest.warns(CompileCacheWarning, match="does not match its manifest"):
        assert not CompileCache(s3_url, _fp()).fetch(tmp_path / "x").found


def _repack(entry, manifest, change) -> dict:
    """What someone with write access to the cache can do: rewrite the archive (`change`
    edits its files) and the manifest's archive size and hash to match, keeping the rest."""
    import hashlib
    import io
    import tarfile

    files = {}
    with tarfile.open(entry / manifest["archive"], "r:gz") as tar:
        for member in tar.getmembers():
            if member.isfile():
                files[member.name] = tar.extractfile(member).read()
    change(files)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = buffer.getvalue()
    (entry / manifest["archive"]).write_bytes(data)
    altered = manifest | {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (entry / "manifest.json").write_text(json.dumps(altered))
    return files


def test_with_a_fleet_key_only_entries_it_signed_are_used(tmp_path):
    url, key = str(tmp_path / "shared"), b"fleet-secret-of-32-random-chars!"
    source = tmp_path / "compiled"
    expected = _inductor_like_dir(source)
    cache = CompileCache(url, _fp(), key)
    assert cache.publish(source) is not None
    entry = tmp_path / "shared" / cache.name
    manifest = json.loads((entry / "manifest.json").read_text())
    assert set(manifest["files"]) == expected and manifest["signature"]["alg"] == "hmac-sha256"
    assert "fleet-secret-of-32-random-chars!" not in (entry / "manifest.json").read_text()
    assert CompileCache(url, _fp(), key).fetch(tmp_path / "ok").found

    with pytest.warns(CompileCacheWarning, match="signed with another key"):
        assert not CompileCache(url, _fp(), b"another").fetch(tmp_path / "other").found

    def flip_a_byte(files):
        files["cd/kernel.so"] = files["cd/kernel.so"][:-1] + bytes([files["cd/kernel.so"][-1] ^ 1])

    def add_a_file(files):
        files["cd/evil.py"] = b"import os; os.system('touch pwned')\n"

    good = (entry / manifest["archive"]).read_bytes()
    for change, without_key in (
        (flip_a_byte, "does not match its manifest's SHA-256"),
        (add_a_file, "a file its manifest does not list"),
    ):
        _repack(entry, manifest, change)
        with pytest.warns(CompileCacheWarning, match="altered after it was signed"):
            assert not CompileCache(url, _fp(), key).fetch(tmp_path / change.__name__).found
        assert not (tmp_path / change.__name__).exists()  # nothing unpacked
        # Without a key the file list still catches an archive changed under its manifest.
        with pytest.warns(CompileCacheWarning, match=without_key):
            assert not CompileCache(url, _fp()).fetch(tmp_path / f"{change.__name__}-nokey").found
        (entry / manifest["archive"]).write_bytes(good)
        (entry / "manifest.json").write_text(json.dumps(manifest))

    unsigned = {k: v for k, v in manifest.items() if k != "signature"}
    (entry / "manifest.json").write_text(json.dumps(unsigned))
    with pytest.warns(CompileCacheWarning, match="is unsigned"):
        assert not CompileCache(url, _fp(), key).fetch(tmp_path / "unsigned").found
    forged = manifest | {"signature": manifest["signature"] | {"value": "0" * 64}}
    (entry / "manifest.json").write_text(json.dumps(forged))
    with pytest.warns(CompileCacheWarning, match="altered after it was signed"):
        assert not CompileCache(url, _fp(), key).fetch(tmp_path / "forged").found


def test_a_remote_cache_without_a_key_is_named_once_as_a_code_channel(s3_url, tmp_path):
    import warnings

    from frugality.compile import cache as cache_module

    cache_module._warned_unsigned.discard(s3_url)
    with pytest.warns(CompileCacheWarning, match="whoever can write there can run code"):
        CompileCache(s3_url, _fp()).fetch(tmp_path / "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CompileCache(s3_url, _fp()).fetch(tmp_path / "b")  # said once per process
        CompileCache(s3_url, _fp(), b"key").fetch(tmp_path / "c")  # a signed cache: nothing to say


def test_a_recipe_cannot_turn_verification_off(micro_recipe_file, monkeypatch):
    from frugality.errors import UserError

    cpu = torch.device("cpu")

    def session(variable):
        recipe = load_recipe(str(micro_recipe_file), ["compile.level=O1", f'compile.cache_key_env="{variable}"'])
        return CompileSession.for_recipe(recipe, cpu, resolve_policy(recipe.train.precision, cpu)[0])

    monkeypatch.setenv("FRUGALITY_CACHE_KEY", "a-fleet-key-of-32-random-chars!!")
    monkeypatch.setenv("OTHER_KEY", "another-key-of-32-random-chars!!")
    with pytest.raises(UserError, match="may not choose another cache key"):
        session("OTHER_KEY")  # nor an unset one, which would turn verification off
    monkeypatch.delenv("FRUGALITY_CACHE_KEY")
    assert session("OTHER_KEY").cache.signed  # without the fleet's variable, naming a key is fine
    monkeypatch.setenv("HOME", "/root")
    with pytest.raises(UserError, match=r"the compile cache key in \$HOME has 5 characters"):
        session("HOME")  # a guessable "key" is refused


def test_cpus_of_few_threads_build_a_graph_with_a_cpp_wrapper_and_key_it():
    """The C++ wrapper (one library for a graph's kernels) up to CPP_WRAPPER_MAX_THREADS
    threads; Inductor's per-kernel libraries beyond. The options are in the entry's key, as
    the thread count is, so machines that share an entry chose alike."""
    from frugality.compile.levels import CPP_WRAPPER_MAX_THREADS, inductor_options

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(CPP_WRAPPER_MAX_THREADS)
        few = inductor_options(torch.device("cpu"), torch.float32)
        torch.set_num_threads(CPP_WRAPPER_MAX_THREADS + 1)
        many = inductor_options(torch.device("cpu"), torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert few["cpp_wrapper"] is True and "cpp_wrapper" not in many
    assert entry_name(_fp(options=few)) != entry_name(_fp(options=many))
    assert "cpp_wrapper" not in inductor_options(torch.device("meta"), torch.float32)  # CPUs only
