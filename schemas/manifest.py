"""ManifestSpec: where a dataset's samples are and how to read each sample's length.

A manifest can be named on the command line directly (a file, a directory or a glob of shards;
the format is detected from the extension) or through a small JSON document of this schema when
the defaults do not fit (a different length field, token-id lists, text with a tokenizer).
The readers live in :mod:`zeppelin.schemas.io.datasets`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .common import Doc

MANIFEST_SCHEMA = "zeppelin.manifest/1"

ManifestFormat = Literal["auto", "jsonl", "parquet", "npy", "txt"]


class ManifestSpec(Doc):
    schema_version: Literal["zeppelin.manifest/1"] = MANIFEST_SCHEMA
    name: str = ""
    description: str = ""
    paths: list[str] = Field(min_length=1, description="files, directories or glob patterns (relative to this file)")
    format: ManifestFormat = "auto"
    length_field: str | None = Field(default="length", description="field/column holding the length")
    tokens_field: str | None = Field(default=None, description="field/column holding a list of token ids")
    text_field: str | None = Field(default=None, description="field/column holding raw text")
    tokenizer: str | None = Field(
        default=None,
        description="for text_field: 'whitespace' or 'bytes' (lengths only), or the path of a Hugging Face "
                    "tokenizer.json or of a directory holding one (token ids); a manifest never names Python code",
    )
    offsets: list[str] | None = Field(
        default=None,
        description="token files: one offsets index (.npy, num_samples + 1 int entries from 0) per entry of "
                    "paths, which then name .npy or raw .bin token-id files",
    )
    token_dtype: Literal["uint8", "uint16", "uint32", "int32", "int64"] | None = Field(
        default=None, description="dtype of raw .bin token files (little-endian)")

    @model_validator(mode="after")
    def _check(self) -> "ManifestSpec":
        if self.text_field and not self.tokenizer:
            raise ValueError("text_field needs a tokenizer ('whitespace', 'bytes' or a tokenizer.json path)")
        return self
