"""Data types of Kiln tensors and PyTorch's type promotion between them."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DataType:
    """One element type: its name, PyTorch dtype, C type and category."""

    name: str
    torch_dtype: torch.dtype
    c_type: str
    nbytes: int
    kind: str  # 'float', 'int', 'uint' or 'bool'

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_integer(self) -> bool:
        return self.kind in ("int", "uint")

    @property
    def is_bool(self) -> bool:
        return self.kind == "bool"

    @property
    def is_16bit_float(self) -> bool:
        return self.kind == "float" and self.nbytes == 2

    def __repr__(self) -> str:
        return self.name

    def __str__(self) -> str:
        return self.name


float64 = DataType("float64", torch.float64, "double", 8, "float")
float32 = DataType("float32", torch.float32, "float", 4, "float")
float16 = DataType("float16", torch.float16, "kiln_half", 2, "float")
bfloat16 = DataType("bfloat16", torch.bfloat16, "kiln_bfloat16", 2, "float")
int64 = DataType("int64", torch.int64, "int64_t", 8, "int")
int32 = DataType("int32", torch.int32, "int32_t", 4, "int")
int16 = DataType("int16", torch.int16, "int16_t", 2, "int")
int8 = DataType("int8", torch.int8, "int8_t", 1, "int")
uint8 = DataType("uint8", torch.uint8, "uint8_t", 1, "uint")
boolean = DataType("bool", torch.bool, "bool", 1, "bool")

ALL = (float64, float32, float16, bfloat16, int64, int32, int16, int8, uint8, boolean)
FLOATS = (float64, float32, float16, bfloat16)
HALF_FLOATS = (float16, bfloat16)
"""The 16-bit floats, which PyTorch computes in float32 and rounds to store."""
INTEGERS = (int64, int32, int16, int8, uint8)

_BY_NAME = {d.name: d for d in ALL}
_BY_NAME.update({"bool": boolean, "half": float16, "float": float32, "double": float64,
                 "long": int64, "int": int32, "bf16": bfloat16, "fp16": float16, "fp32": float32})
_BY_TORCH = {d.torch_dtype: d for d in ALL}


def data_type(value) -> DataType:
    """Return the DataType for a DataType, a name ('float32'), a torch.dtype or a Python type."""
    if isinstance(value, DataType):
        return value
    if isinstance(value, str) and value in _BY_NAME:
        return _BY_NAME[value]
    if isinstance(value, torch.dtype) and value in _BY_TORCH:
        return _BY_TORCH[value]
    if value is bool:
        return boolean
    if value is int:
        return int64
    if value is float:
        return float32
    supported = ", ".join(d.name for d in ALL)
    raise TypeError(f"unsupported data type {value!r}; Kiln supports {supported}")


def promote(*types: DataType) -> DataType:
    """The result type of combining tensors of these types, as PyTorch promotes them."""
    result = types[0].torch_dtype
    for t in types[1:]:
        result = torch.promote_types(result, t.torch_dtype)
    return _BY_TORCH[result]


def scalar_type(value) -> DataType:
    """The default type of a Python scalar: bool, int64 or float32."""
    if isinstance(value, bool):
        return boolean
    if isinstance(value, int):
        return int64
    if isinstance(value, float):
        return float32
    raise TypeError(f"expected a Python scalar, got {type(value).__name__}")


def promote_with_scalar(tensor_type: DataType, value) -> DataType:
    """The result type of a tensor combined with a Python scalar (PyTorch's rule: the scalar
    only lifts the category, bool < integer < float, never the width within it)."""
    if isinstance(value, bool) or tensor_type.is_float:
        return tensor_type
    if isinstance(value, int):
        return int64 if tensor_type.is_bool else tensor_type
    return float32
