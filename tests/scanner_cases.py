"""Structured JPEG/PNG headers aimed at the scanner's edges: EXIF with odd or far IFD offsets in
both byte orders, XMP, segments and chunks straddling the 4 KiB head, files of 4095/4096/4097
bytes, PNG chunk lengths near 2**32, fill and junk bytes, several APP1s, padding after the end
marker. Written for an independent review of shardkit/_scan.c; the scanner tests replay them."""

from __future__ import annotations

import random
import struct


def tiff(rng: random.Random) -> bytes:
    little = rng.random() < 0.5
    e = "<" if little else ">"
    body = bytearray(b"II" if little else b"MM")
    body += struct.pack(e + "H", 42)
    ifd = rng.choice([8, 8, 9, 7, 3, 0, rng.randrange(0, 200), rng.randrange(0, 1 << 32)])
    body += struct.pack(e + "I", ifd)
    while len(body) < ifd and len(body) < 300:
        body.append(rng.randrange(256))
    count = rng.choice([1, 2, 3, rng.randrange(0, 20), 0xFFFF])
    entries = bytearray()
    for _ in range(min(count, 6)):
        tag = rng.choice([0x0112, 0x0112, 0x010F, rng.randrange(65536)])
        value = rng.choice([1, 3, 6, 8, 0, 9, rng.randrange(65536)])
        entries += struct.pack(e + "HHI", tag, 3, 1) + struct.pack(e + "H", value) + b"\0\0"
    if ifd <= len(body):
        body = body[:ifd] + struct.pack(e + "H", count) + entries
    cut = rng.random()
    if cut < 0.3:
        body = body[: rng.randrange(len(body) + 1)]
    elif cut < 0.5:
        body += bytes(rng.randrange(0, 40))
    return bytes(body)


def seg(marker: int, payload: bytes) -> bytes:
    payload = payload[:65533]
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def jpeg(rng: random.Random) -> bytes:
    out = bytearray(b"\xff\xd8")
    target = rng.choice([None, 4096, 4095, 4097, 4094, 4100, 4090, 8192])
    for _ in range(rng.randrange(0, 5)):
        r = rng.random()
        if r < 0.35:
            out += seg(0xE1, b"Exif\0\0" + tiff(rng))
        elif r < 0.45:
            out += seg(0xE1, b"http://ns.adobe.com/xap/1.0/\0" + b'<x tiff:Orientation="6"/>')
        elif r < 0.6:
            out += seg(rng.choice([0xE0, 0xE2, 0xED, 0xFE]), bytes(rng.randrange(0, 5000)))
        elif r < 0.7:
            out += b"\xff" * rng.randrange(1, 4)  # fill bytes
        elif r < 0.8:
            out += bytes([rng.randrange(0xD0, 0xD8)]).join([b"\xff", b""])  # RSTn
        elif r < 0.9:
            out += bytes(rng.randrange(256) & 0xFE for _ in range(rng.randrange(1, 8)))  # junk
        else:
            out += seg(0xE1, b"Exif\0\0" + tiff(rng) + bytes(rng.randrange(60000, 65400)))
    if target is not None:
        # pad so the SOF (or an EXIF) starts at a chosen place around the 4 KiB boundary
        want = target - rng.randrange(0, 24) - len(out) - 4
        if want >= 0:
            if rng.random() < 0.5:
                out += seg(0xE2, bytes(want))
                if rng.random() < 0.5:
                    out += seg(0xE1, b"Exif\0\0" + tiff(rng))
            else:
                out += seg(0xE1, b"Exif\0\0" + tiff(rng) + bytes(max(0, want - 200)))
    sof = rng.choice([0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF])
    comps = rng.choice([1, 3, 3, 4, 2])
    w, h = rng.choice([1, 7, 300, 65535]), rng.choice([1, 9, 200, 65535])
    out += seg(sof, bytes([8]) + struct.pack(">HH", h, w) + bytes([comps]) + bytes(3 * comps))
    out += seg(0xC4, bytes(20)) + seg(0xDA, bytes(10)) + bytes(rng.randrange(0, 300))
    out += b"\xff\xd9" + bytes(rng.choice([0, 0, 1, 29, 30, 31, 32, 40]))
    end = rng.choice([None, None, 4096, 4095, 4097])
    if end is not None:
        if len(out) < end:
            out[-2 - 0 :] = b""
            out += bytes(end - len(out) - 2) + b"\xff\xd9"
        else:
            out = out[:end] if rng.random() < 0.3 else out
    return bytes(out)


def chunk(kind: bytes, payload: bytes, length: int | None = None) -> bytes:
    return struct.pack(">I", len(payload) if length is None else length) + kind + payload + b"\0\0\0\0"


def png(rng: random.Random) -> bytes:
    color, bits = rng.choice(
        [(0, 1), (0, 8), (0, 16), (2, 8), (2, 16), (3, 4), (4, 8), (6, 8), (6, 16), (2, 4), (5, 8)]
    )
    ihdr = struct.pack(">II", rng.choice([1, 5, 2**32 - 1, 100000]), rng.choice([1, 3, 2**31])) + bytes(
        [bits, color, 0, 0, rng.choice([0, 1, 2])]
    )
    out = bytearray(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr))
    target = rng.choice([None, 4096, 4095, 4097, 4093, 4100, 8192])
    for _ in range(rng.randrange(0, 5)):
        r = rng.random()
        if r < 0.3:
            payload = tiff(rng)
            if rng.random() < 0.5:
                payload = b"Exif\0\0" + payload
            out += chunk(b"eXIf", payload)
        elif r < 0.5:
            out += chunk(b"tRNS", bytes(6))
        elif r < 0.7:
            out += chunk(b"tEXt", bytes(rng.randrange(0, 5000)))
        elif r < 0.8:
            # a length near 2**32: points far past the end
            out += chunk(b"zzZz", b"", length=rng.choice([2**32 - 1, 2**32 - 12, 2**31, 0xFFFFFFF4]))
        else:
            out += chunk(b"eXIf", b"Exif\0\0" + tiff(rng) + bytes(rng.randrange(60000, 70000)))
    if target is not None:
        want = target - rng.randrange(0, 16) - len(out) - 12
        if want >= 0:
            out += chunk(b"tEXt", bytes(want))
            r = rng.random()
            if r < 0.4:
                out += chunk(b"eXIf", b"Exif\0\0" + tiff(rng))
            elif r < 0.7:
                out += chunk(b"tRNS", bytes(2))
    out += chunk(b"IDAT", bytes(rng.randrange(0, 100)))
    out += chunk(b"IEND", b"") + bytes(rng.choice([0, 0, 1, 20, 28, 29, 40]))
    end = rng.choice([None, None, 4096, 4095, 4097])
    if end is not None:
        out = out[:-12] + bytes(end - len(out)) + chunk(b"IEND", b"") if len(out) < end else out[:end]
    return bytes(out)


def mutate(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(0, 3)):
        if not data:
            break
        c = rng.random()
        if c < 0.6:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif c < 0.8:
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        else:
            at = rng.randrange(len(data))
            del data[at : at + rng.randint(1, 8)]
    return bytes(data)


EXTS = [".jpg", ".png", ".JPG", ".jpeg", ".jfif", ".jpe", ".apng", ".PnG", ""]
