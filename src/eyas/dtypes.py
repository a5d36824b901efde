"""dtype names, in one table each: the names configs write (``target.dtype``, ``extract.dtype``,
``extract.compute_dtype``, a store header's ``dtype``) and the codes safetensors headers write."""

from __future__ import annotations

import torch

#: config / store-header dtype name -> torch dtype
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: torch dtype -> safetensors header code (safetensors README, "dtype")
SAFETENSORS_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}

#: safetensors header code -> torch dtype
FROM_SAFETENSORS_CODE: dict[str, torch.dtype] = {code: dt for dt, code in SAFETENSORS_CODES.items()}
