#!/usr/bin/python3
"""Reads a safetensors file by hand (8-byte little-endian header length, JSON
header, raw little-endian data) with numpy and compares every tensor with the
reference the test wrote: REF.json ([{"name", "numel", "at"}], "at" in
elements of REF.bin, the gathered fp32 master weights).
Usage: check_safetensors.py FILE f32|bf16 REF.json REF.bin
Exit 0 if equal (f32 bitwise; bf16 = the reference rounded to nearest even)."""
import json
import sys

import numpy as np


def fail(msg):
    print("check_safetensors: " + msg)
    sys.exit(1)


def bf16_rne(f32_bits):
    u = f32_bits.astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    quiet = ((u >> 16) | 0x40) & 0xFFFF
    return np.where(nan, quiet, rounded).astype(np.uint16)


def main():
    path, dtype, ref_json, ref_bin = sys.argv[1:5]
    blob = open(path, "rb").read()
    n = int.from_bytes(blob[:8], "little")
    if n % 8 or 8 + n > len(blob):
        fail(f"header length {n} is not a multiple of 8 or runs past the file")
    text = blob[8:8 + n].decode("utf-8")
    if not text.startswith("{") or text.rstrip(" ") != text.rstrip():
        fail("header is not a JSON object padded with spaces")
    header = json.loads(text)
    data = blob[8 + n:]
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("producer") != "strata" or meta.get("format") != "pt" \
            or not all(isinstance(v, str) for v in meta.values()):
        fail(f"__metadata__ {meta!r}")
    ref = json.load(open(ref_json))
    ref_w = np.fromfile(ref_bin, dtype="<u4")
    if set(header) != {t["name"] for t in ref}:
        fail(f"tensor names differ: {sorted(header)[:5]}... vs the reference")
    # Data offsets must tile the data section without holes or overlaps.
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    at = 0
    for b, e in spans:
        if b != at or e < b:
            fail(f"data_offsets [{b}, {e}] leave a hole or overlap at {at}")
        at = e
    if at != len(data):
        fail(f"data section is {len(data)} bytes, the tensors cover {at}")
    want_dtype, size = ("F32", 4) if dtype == "f32" else ("BF16", 2)
    for t in ref:
        h = header[t["name"]]
        if h["dtype"] != want_dtype or h["shape"] != [t["numel"]]:
            fail(f"{t['name']}: dtype {h['dtype']} shape {h['shape']}, expected {want_dtype} [{t['numel']}]")
        b, e = h["data_offsets"]
        if e - b != t["numel"] * size:
            fail(f"{t['name']}: {e - b} bytes for {t['numel']} elements")
        want = ref_w[t["at"]:t["at"] + t["numel"]]
        if dtype == "f32":
            got = np.frombuffer(data, dtype="<u4", count=t["numel"], offset=b)
        else:
            got = np.frombuffer(data, dtype="<u2", count=t["numel"], offset=b)
            want = bf16_rne(want)
        bad = np.nonzero(got != want)[0]
        if bad.size:
            i = int(bad[0])
            fail(f"{t['name']}[{i}]: {int(got[i]):#x} != {int(want[i]):#x} ({bad.size} elements differ)")
    print(f"check_safetensors: {len(ref)} tensors, {sum(t['numel'] for t in ref)} elements equal ({dtype})")


if __name__ == "__main__":
    main()
