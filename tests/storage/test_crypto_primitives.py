"""The primitives under tenant-encrypted records: XAES-256-GCM (storage/xaes.py) against the
C2SP test vectors, the keyed names (storage/names.py), key files (owner, symlinks, fstat,
tenant key files, durable writes), tenant names (NFC) and the associated data's widths."""

from __future__ import annotations

import os
import stat
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("cryptography", reason="encryption needs the cryptography package (the encryption extra)")

from tiered_kv.storage import EncryptionConfig, KeyFileError, RecordKey, RecordKind  # noqa: E402
from tiered_kv.storage import crypto  # noqa: E402
from tiered_kv.storage.encrypted.crypto import (  # noqa: E402
    Keyring,
    load_key_file,
    read_key_file,
    tenant_bytes,
    write_key_file,
    write_tenant_key_file,
)
from tiered_kv.storage.encrypted.names import KeyedNames  # noqa: E402
from tiered_kv.storage.encrypted.xaes import Xaes256Gcm  # noqa: E402

NONCE = b"ABCDEFGHIJKLMNOPQRSTUVWX"


# ------------------------------------------------------------------ XAES-256-GCM
@pytest.mark.parametrize("key, aad, kx, ct", [
    (b"\x01" * 32, b"", "c8612c9ed53fe43e8e005b828a1631a0bbcb6ab2f46514ec4f439fcfd0fa969b",
     "ce546ef63c9cc60765923609b33a9a1974e96e52daf2fcf7075e2271"),
    (b"\x03" * 32, b"c2sp.org/XAES-256-GCM", "e9c621d4cdd9b11b00a6427ad7e559aeedd66b3857646677748f8ca796cb3fd8",
     "986ec1832593df5443a179437fd083bf3fdb41abd740a21f71eb769d"),
], ids=["msb0", "msb1"])
def test_xaes_matches_the_c2sp_vectors(key: bytes, aad: bytes, kx: str, ct: str) -> None:
    """https://c2sp.org/XAES-256-GCM, "Test vectors": the derived key and the ciphertext
    (the first vector has the top bit of L clear, the second set)."""
    from cryptography.exceptions import InvalidTag

    x = Xaes256Gcm(key)
    assert x.subkey(NONCE).hex() == kx
    assert x.encrypt(NONCE, b"XAES-256-GCM", aad).hex() == ct
    assert x.decrypt(NONCE, bytes.fromhex(ct), aad) == b"XAES-256-GCM"
    forged = bytearray.fromhex(ct)
    forged[3] ^= 1
    with pytest.raises(InvalidTag):
        x.decrypt(NONCE, bytes(forged), aad)
    with pytest.raises(ValueError, match="nonce: expected 24 bytes"):
        x.subkey(NONCE[:12])


def test_xaes_streaming_decryptor_agrees_with_the_one_shot() -> None:
    x = Xaes256Gcm(os.urandom(32))
    nonce, msg = os.urandom(24), os.urandom(5000)
    ct = x.encrypt(nonce, msg, b"aad")
    d = x.decryptor(nonce, b"aad")
    out = bytearray(len(msg))
    d.update_into(ct[:1234], memoryview(out)[:1234])
    d.update_into(ct[1234:-16], memoryview(out)[1234:])
    d.finalize_with_tag(ct[-16:])
    assert bytes(out) == msg


# ------------------------------------------------------------------ keyed names
@settings(max_examples=200, deadline=None)
@given(key=st.binary(min_size=32, max_size=32), h=st.binary(min_size=32, max_size=32),
       kind=st.sampled_from([1, 2]))
def test_names_are_a_keyed_permutation(key: bytes, h: bytes, kind: int) -> None:
    names = KeyedNames(key)
    n = names.name(kind, h)
    assert len(n) == 32 and names.key_of(kind, n) == h
    assert n != names.name(3 - kind, h)  # the kind tweaks it
    other = bytes([key[0] ^ 1]) + key[1:]
    assert KeyedNames(other).name(kind, h) != n  # (distinct with overwhelming probability)


def test_names_depend_on_the_master_key_and_the_tenant(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_key_file(a)
    write_key_file(b)
    k = RecordKey.block(bytes(range(32)))
    names = {(str(f), t): Keyring(EncryptionConfig(key_files=[str(f)], tenant=t)).current.name(k)
             for f in (a, b) for t in ("acme", "globex")}
    assert len(set(names.values())) == 4 and k not in names.values()
    ring = Keyring(EncryptionConfig(key_files=[str(a)], tenant="acme"))
    assert ring.current.key_of(names[(str(a), "acme")]) == k
    assert ring.current.name(RecordKey.snapshot(k.block_hash)).kind is RecordKind.SNAPSHOT


# ------------------------------------------------------------------ key files
def test_a_key_file_is_checked_on_the_file_opened_through_a_symlink(tmp_path: Path) -> None:
    """Kubernetes mounts a secret as a chain of symlinks (key -> ..data/key -> ..2024/key):
    it is followed, and the file it ends at is what must be owner-only and regular."""
    real = tmp_path / "..2024_01" / "key"
    real.parent.mkdir()
    write_key_file(real)
    (tmp_path / "..data").symlink_to(real.parent.name)
    link = tmp_path / "key"
    link.symlink_to(Path("..data") / "key")
    assert read_key_file(link) == real.read_bytes()
    os.chmod(real, 0o644)  # the target, not the link, is what counts
    with pytest.raises(KeyFileError, match="mode 0644 .*group or others"):
        read_key_file(link)
    os.chmod(real, 0o400)
    assert len(read_key_file(link)) == 32
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(KeyFileError, match="expected a regular file"):  # (opened without blocking)
        read_key_file(fifo)
    (tmp_path / "dir").mkdir(mode=0o700)
    with pytest.raises(KeyFileError, match="regular file"):
        read_key_file(tmp_path / "dir")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_key_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "k"
    write_key_file(path)
    os.chown(path, 12345, -1)
    with pytest.raises(KeyFileError, match=r"owned by uid 12345; expected the running user \(uid 0\) or root"):
        read_key_file(path)
    os.chown(path, 0, -1)
    assert len(read_key_file(path)) == 32


def test_a_key_file_owned_by_root_is_accepted_for_another_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The running user or root: a root-owned secret mount read by a service user."""
    path = tmp_path / "k"
    write_key_file(path)
    owner = path.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    if owner == 0:
        assert len(read_key_file(path)) == 32
    else:
        with pytest.raises(KeyFileError, match=f"owned by uid {owner}"):
            read_key_file(path)


def test_write_key_file_writes_every_byte_and_syncs_the_directory(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    real_write, real_fsync = os.write, os.fsync
    synced: list[bool] = []
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:5]))  # short writes
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)), real_fsync(fd)))
    key_id = write_key_file(tmp_path / "k")
    assert len((tmp_path / "k").read_bytes()) == 32 and synced == [False, True]  # the file, then its directory
    assert load_key_file(tmp_path / "k").key_id.hex() == key_id
    monkeypatch.setattr(os, "write", lambda fd, data: 0)  # a write that makes no progress
    with pytest.raises(OSError, match="short write"):
        write_key_file(tmp_path / "k2")
    assert not (tmp_path / "k2").exists()  # no truncated key is left behind
    (tmp_path / "target").write_bytes(b"")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    monkeypatch.setattr(os, "write", real_write)
    with pytest.raises(FileExistsError):  # never written through a link, never overwritten
        write_key_file(tmp_path / "link")


def test_a_tenant_key_file_serves_its_tenant_and_no_other(tmp_path: Path) -> None:
    master = tmp_path / "master"
    write_key_file(master)
    acme = tmp_path / "acme.key"
    assert write_tenant_key_file(acme, master, "acme") == load_key_file(master).key_id.hex()
    assert stat.S_IMODE(acme.stat().st_mode) == 0o600 and master.read_bytes() not in acme.read_bytes()
    f = load_key_file(acme)
    assert f.master is None and f.tenant == b"acme"
    from_master = Keyring(EncryptionConfig(key_files=[str(master)], tenant="acme"))
    from_file = Keyring(EncryptionConfig(key_files=[str(acme)]))  # the tenant comes from the file
    assert from_file.tenant == b"acme" and from_file.key_ids == from_master.key_ids
    k = RecordKey.block(bytes(32))
    assert from_file.current.name(k) == from_master.current.name(k)
    assert from_file.current.xaes.subkey(NONCE) == from_master.current.xaes.subkey(NONCE)
    with pytest.raises(KeyFileError, match="a tenant key file of tenant 'acme'; it cannot serve tenant 'globex'"):
        Keyring(EncryptionConfig(key_files=[str(acme)], tenant="globex"))
    with pytest.raises(KeyFileError, match="expected a master key"):
        write_tenant_key_file(tmp_path / "again", acme, "globex")
    raw = bytearray(acme.read_bytes())
    raw[20] ^= 1
    damaged = tmp_path / "damaged.key"
    damaged.write_bytes(bytes(raw))
    damaged.chmod(0o600)
    with pytest.raises(KeyFileError, match="damaged tenant key file"):
        load_key_file(damaged)
    with pytest.raises(FileExistsError):
        write_tenant_key_file(acme, master, "acme")


def test_tenant_names_are_nfc_normalized() -> None:
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    assert unicodedata.normalize("NFC", decomposed) == composed and composed != decomposed
    assert tenant_bytes(decomposed) == tenant_bytes(composed) == composed.encode()
    assert tenant_bytes(b"cafe\xcc\x81") == b"cafe\xcc\x81"  # bytes are taken as they are
    with pytest.raises(ValueError, match="at most 1024 bytes"):
        tenant_bytes("x" * 1025)


def test_the_associated_data_has_fixed_width_fields(tmp_path: Path) -> None:
    write_key_file(tmp_path / "k")
    ring = Keyring(EncryptionConfig(key_files=[str(tmp_path / "k")], tenant="t"))
    fp = crypto.fingerprint_field("kvl1-x")
    k = RecordKey.block(bytes(32))
    head = bytes(40)
    assert len(ring._aad(2, head, k, bytes(32), bytes(32), fp)) == 20 + 16 + 1 + 32 * 4 + 2 + 1
    for bad in ((head[:15], bytes(32), bytes(32), fp, "envelope head"), (head, bytes(31), bytes(32), fp, "parent"),
                (head, bytes(32), bytes(33), fp, "token digest"), (head, bytes(32), bytes(32), fp[:31], "fingerprint")):
        with pytest.raises(ValueError, match=f"associated data: .*{bad[4]}"):
            ring._aad(2, bad[0], k, bad[1], bad[2], bad[3])


def test_a_default_tenant_yields_to_a_tenant_key_file(tmp_path: Path) -> None:
    """A cache defaults the tenant to its salt; a tenant key file names its own, which wins
    (the node serves that tenant), and an explicit tenant must match it."""
    from tiered_kv.storage.encrypted.crypto import default_tenant

    master, acme = tmp_path / "m", tmp_path / "acme.key"
    write_key_file(master)
    write_tenant_key_file(acme, master, "acme")
    opts = default_tenant({"encryption": {"key_files": [str(acme)]}}, "some-salt")
    assert Keyring(opts["encryption"]).tenant == b"acme"
    opts = default_tenant({"encryption": {"key_files": [str(master)]}}, "some-salt")
    assert Keyring(opts["encryption"]).tenant == b"some-salt"
    opts = default_tenant({"encryption": {"key_files": [str(master)], "tenant": "t"}}, "some-salt")
    assert Keyring(opts["encryption"]).tenant == b"t"
