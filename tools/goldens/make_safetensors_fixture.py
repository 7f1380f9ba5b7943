#!/usr/bin/env python3
"""Writes tests/unit/model/fixtures/py_fixture.safetensors with the Python `safetensors`
package (the reference writer) and py_fixture_expected.json with what each tensor must read as.
safetensors_test.cpp maps the file with m3::model::SafetensorsFile and compares every byte and
decoded value, so the C++ reader is checked against an independent writer.

One tensor per dtype m3serve reads (F32 F16 BF16 F8_E4M3 U8 I8 I32 I64 F64 BOOL), plus a scalar
and an empty tensor, and a __metadata__ map. BF16 bits are rounded from float32 here with
round-to-nearest-even (numpy); F8_E4M3 covers all 256 codes, decoded here from the OCP E4M3FN
definition (bias 7, no infinities, S.1111.111 NaN -> null in JSON).

    python tools/goldens/make_safetensors_fixture.py
Versions used are recorded in the expected JSON ("versions").
"""
import json
import math
import os
import sys

import numpy as np
import safetensors
from safetensors import TensorSpec, serialize

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "unit",
                   "model", "fixtures")


def bf16_bits(x):
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return r.astype(np.uint16)


def e4m3_value(code):
    s = -1.0 if code & 0x80 else 1.0
    e = (code >> 3) & 0xF
    m = code & 0x7
    if e == 0xF and m == 0x7:
        return None  # NaN
    if e == 0:
        return s * (m / 8.0) * 2.0 ** -6
    return s * (1.0 + m / 8.0) * 2.0 ** (e - 7)


def json_float(v):
    v = float(v)
    return None if math.isnan(v) else v


def main():
    rng = np.random.default_rng(1234)
    arrays = {}  # name -> (safetensors dtype name for TensorSpec, header dtype, numpy buffer, shape)
    expected = {}

    f32 = np.array([[1.5, -2.25, 3.0e-8], [1.0e30, -0.0, 7.0]], dtype=np.float32)
    arrays["layers.0.f32"] = ("float32", f32, [2, 3])
    expected["layers.0.f32"] = {"dtype": "F32", "shape": [2, 3],
                                "values": [json_float(v) for v in f32.ravel()]}

    f16 = np.array([0.5, -1.0, 65504.0, 6.1035156e-05, 5.9604645e-08], dtype=np.float16)
    arrays["layers.0.f16"] = ("float16", f16, [5])
    expected["layers.0.f16"] = {"dtype": "F16", "shape": [5],
                                "values": [json_float(v) for v in f16.astype(np.float32)]}

    src = rng.standard_normal((3, 4)).astype(np.float32) * 10.0
    bits = bf16_bits(src)
    arrays["layers.0.bf16"] = ("bfloat16", bits, [3, 4])
    expected["layers.0.bf16"] = {
        "dtype": "BF16", "shape": [3, 4],
        "source_f32": [json_float(v) for v in src.ravel()],
        "bits": [int(b) for b in bits.ravel()],
        "values": [json_float(np.uint32(int(b) << 16).view(np.float32)) for b in bits.ravel()]}

    codes = np.arange(256, dtype=np.uint8)
    arrays["layers.1.f8"] = ("float8_e4m3fn", codes, [16, 16])
    expected["layers.1.f8"] = {"dtype": "F8_E4M3", "shape": [16, 16],
                               "bits": [int(c) for c in codes],
                               "values": [e4m3_value(int(c)) for c in codes]}

    u8 = np.array([0, 1, 127, 128, 255], dtype=np.uint8)
    arrays["layers.1.u8"] = ("uint8", u8, [5])
    expected["layers.1.u8"] = {"dtype": "U8", "shape": [5], "ints": [int(v) for v in u8]}

    i8 = np.array([-128, -1, 0, 1, 127], dtype=np.int8)
    arrays["layers.1.i8"] = ("int8", i8, [5])
    expected["layers.1.i8"] = {"dtype": "I8", "shape": [5], "ints": [int(v) for v in i8]}

    i32 = np.array([[-2147483648, -1], [0, 2147483647]], dtype=np.int32)
    arrays["layers.2.i32"] = ("int32", i32, [2, 2])
    expected["layers.2.i32"] = {"dtype": "I32", "shape": [2, 2], "ints": [int(v) for v in i32.ravel()]}

    i64 = np.array([-(2 ** 62), -3, 0, 2 ** 40 + 7], dtype=np.int64)
    arrays["layers.2.i64"] = ("int64", i64, [4])
    expected["layers.2.i64"] = {"dtype": "I64", "shape": [4], "ints": [int(v) for v in i64]}

    f64 = np.array([math.pi, -1.0e-300, 1.0e300], dtype=np.float64)
    arrays["layers.2.f64"] = ("float64", f64, [3])
    expected["layers.2.f64"] = {"dtype": "F64", "shape": [3], "values": [float(v) for v in f64]}

    bools = np.array([True, False, True, True], dtype=np.bool_)
    arrays["vision.mask"] = ("bool", bools, [2, 2])
    expected["vision.mask"] = {"dtype": "BOOL", "shape": [2, 2], "ints": [int(v) for v in bools]}

    scalar = np.array(0.125, dtype=np.float32)
    arrays["scale"] = ("float32", scalar, [])
    expected["scale"] = {"dtype": "F32", "shape": [], "values": [0.125]}

    empty = np.zeros((0, 4), dtype=np.float32)
    arrays["empty"] = ("float32", empty, [0, 4])
    expected["empty"] = {"dtype": "F32", "shape": [0, 4], "values": []}

    specs = {}
    for name, (dtype, arr, shape) in arrays.items():
        arr = np.ascontiguousarray(arr)
        arrays[name] = (dtype, arr, shape)
        specs[name] = TensorSpec(dtype=dtype, shape=shape, data_ptr=arr.ctypes.data,
                                 data_len=arr.nbytes)
    metadata = {"format": "pt", "producer": "m3serve make_safetensors_fixture.py"}
    blob = bytes(serialize(specs, metadata=metadata))

    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "py_fixture.safetensors"), "wb") as f:
        f.write(blob)

    # Read it back with the reference reader, so the expected JSON describes the file as written.
    # (numpy has no bf16/fp8, so those two are checked by the C++ test only.)
    with safetensors.safe_open(os.path.join(OUT, "py_fixture.safetensors"), framework="np") as f:
        assert set(f.keys()) == set(expected) and f.metadata() == metadata
        assert np.array_equal(f.get_tensor("layers.2.i64"), i64)
        assert np.array_equal(f.get_tensor("layers.0.f32"), f32)

    doc = {"metadata": metadata, "tensors": expected,
           "versions": {"safetensors": safetensors.__version__, "numpy": np.__version__,
                        "python": sys.version.split()[0]}}
    with open(os.path.join(OUT, "py_fixture_expected.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print("wrote", len(blob), "bytes,", len(expected), "tensors")


if __name__ == "__main__":
    main()
