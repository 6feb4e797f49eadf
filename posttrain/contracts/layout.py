"""Key contracts: which TensorDict keys hold which fields, with dtype and symbolic shape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from tensordict import TensorDictBase

from posttrain.contracts.keys import Key, norm_key
from posttrain.contracts.validation import ContractViolation, Violation, layout_violations

DTypeName = Literal["bool", "int32", "int64", "float16", "bfloat16", "float32", "float64"]


class LayoutField(BaseModel):
    """One semantic field of a layout.

    ``shapes`` lists the allowed symbolic shapes; ``"B"`` stands for all batch dims, other
    symbols (``"T"``) must agree across the fields of one TensorDict.

    Example:
        >>> f = LayoutField(name="reward", key=("next", "reward"), dtype="float32",
        ...                 shapes=(("B",),), meaning="per-sequence reward")
        >>> f.key, f.required
        (('next', 'reward'), False)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Semantic name; contracts and remaps use it, not the key.")
    key: tuple[str, ...] = Field(description="Default TensorDict key.")
    dtype: DTypeName
    shapes: tuple[tuple[str, ...], ...] = Field(description="Allowed symbolic shapes.")
    required: bool = False
    is_mask: bool = False
    read_where: str | None = Field(
        default=None, description="Mask field outside which values are unspecified."
    )
    meaning: str

    @field_validator("key", mode="before")
    @classmethod
    def _key(cls, v: Key) -> tuple[str, ...]:
        return norm_key(v)

    @model_validator(mode="after")
    def _shapes(self) -> LayoutField:
        if not self.shapes or any(not s or s[0] != "B" for s in self.shapes):
            raise ValueError(f"field {self.name!r}: every shape starts with the batch symbol 'B'")
        if self.is_mask and self.dtype != "bool":
            raise ValueError(f"field {self.name!r}: a mask is bool")
        return self


class Layout(BaseModel):
    """A named, versioned set of fields: the key contract of a TensorDict.

    Example:
        >>> from posttrain.contracts import LLM_LAYOUT_V1
        >>> LLM_LAYOUT_V1.field("tokens").key
        ('tokens', 'full')
        >>> LLM_LAYOUT_V1.remap({"tokens": "input_ids"}).field("tokens").key
        ('input_ids',)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    version: str
    fields: tuple[LayoutField, ...]
    implies: tuple[tuple[str, str], ...] = Field(
        default=(), description="(a, b): mask a is True only where mask b is True."
    )

    @model_validator(mode="after")
    def _unique(self) -> Layout:
        names = [f.name for f in self.fields]
        keys = [f.key for f in self.fields]
        if len(set(names)) != len(names) or len(set(keys)) != len(keys):
            raise ValueError(f"layout {self.name!r}: field names and keys must be unique")
        for f in self.fields:
            if f.read_where is not None and f.read_where not in names:
                raise ValueError(f"field {f.name!r}: read_where names unknown {f.read_where!r}")
        for a, b in self.implies:
            if a not in names or b not in names:
                raise ValueError(f"layout {self.name!r}: implies names unknown fields {a!r}, {b!r}")
        return self

    def field(self, name: str) -> LayoutField:
        """The field with this semantic name."""
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(
            f"layout {self.name} v{self.version} has no field {name!r}; "
            f"fields: {', '.join(f.name for f in self.fields)}"
        )

    def key(self, name: str) -> tuple[str, ...]:
        """The key of the field with this semantic name."""
        return self.field(name).key

    def remap(self, keys: Mapping[str, Key]) -> Layout:
        """Return a copy whose fields live under other keys (like TorchRL's ``set_keys``)."""
        for name in keys:
            self.field(name)  # raises a KeyError naming the fields
        fields = tuple(
            f.model_copy(update={"key": norm_key(keys[f.name])}) if f.name in keys else f
            for f in self.fields
        )
        return Layout(name=self.name, version=self.version, fields=fields, implies=self.implies)

    def require(self, *names: str) -> Layout:
        """Return a copy where these fields are required too (a consumer's needs)."""
        for name in names:
            self.field(name)
        fields = tuple(
            f.model_copy(update={"required": True}) if f.name in names else f for f in self.fields
        )
        return Layout(name=self.name, version=self.version, fields=fields, implies=self.implies)

    def violations(
        self,
        td: TensorDictBase,
        *,
        require: tuple[str, ...] = (),
        strict: bool = False,
        ragged: bool = False,
        deep: bool = False,
        any_float: bool = False,
    ) -> list[Violation]:
        """Every violation of this layout by ``td`` (empty when it conforms); never raises.

        Metadata only (keys, dtypes, shapes, requires_grad) unless ``deep=True``, which also
        reads mask and log-prob values (LAY-004, LAY-007). ``require`` adds fields the consumer
        needs; ``strict`` rejects keys outside the layout; ``ragged`` lets 'T' differ between
        items; ``any_float`` accepts any floating dtype for a float field (for a consumer that
        casts). :meth:`validate_batch` raises instead.

        Example:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> td = TensorDict({("tokens", "full"): torch.zeros(2, 3, dtype=torch.int64),
            ...                  ("masks", "all_attention_mask"): torch.ones(2, 3, dtype=torch.bool),
            ...                  ("masks", "all_assistant_mask"): torch.ones(2, 3)}, batch_size=[2])
            >>> [str(v) for v in LLM_LAYOUT_V1.violations(td)]
            ["LAY-002 key ('masks', 'all_assistant_mask'): expected dtype bool, found dtype float32"]
        """
        return layout_violations(
            td, self, require=require, strict=strict, ragged=ragged, deep=deep, any_float=any_float
        )

    def validate_batch(
        self,
        td: TensorDictBase,
        *,
        require: tuple[str, ...] = (),
        strict: bool = False,
        ragged: bool = False,
        deep: bool = False,
        any_float: bool = False,
        context: str = "",
    ) -> None:
        """Raise one ``ContractViolation`` listing every :meth:`violations`; return quietly
        when ``td`` conforms. ``context`` prefixes the message (what was being done).

        Example:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> td = TensorDict({("tokens", "full"): torch.zeros(2, 3, dtype=torch.int64),
            ...                  ("masks", "all_attention_mask"): torch.ones(2, 3, dtype=torch.bool),
            ...                  ("masks", "all_assistant_mask"): torch.ones(2, 3, dtype=torch.bool)},
            ...                 batch_size=[2])
            >>> LLM_LAYOUT_V1.validate_batch(td)
            >>> LLM_LAYOUT_V1.validate_batch(td, require=("advantage",))
            Traceback (most recent call last):
            ...
            posttrain.contracts.validation.ContractViolation: 1 contract violation(s)
              - LAY-001 key 'advantage': expected advantage (float32 [*B]), found no such key
        """
        found = self.violations(
            td, require=require, strict=strict, ragged=ragged, deep=deep, any_float=any_float
        )
        if found:
            raise ContractViolation(found, context)


LLM_LAYOUT_V1 = Layout(
    name="llm",
    version="1.0",
    fields=(
        LayoutField(
            name="tokens",
            key=("tokens", "full"),
            dtype="int64",
            shapes=(("B", "T"),),
            required=True,
            meaning="prompt then response token ids",
        ),
        LayoutField(
            name="attention_mask",
            key=("masks", "all_attention_mask"),
            dtype="bool",
            shapes=(("B", "T"),),
            required=True,
            is_mask=True,
            meaning="real (non-pad) tokens",
        ),
        LayoutField(
            name="assistant_mask",
            key=("masks", "all_assistant_mask"),
            dtype="bool",
            shapes=(("B", "T"),),
            required=True,
            is_mask=True,
            meaning="tokens the policy loss trains on; implies attention_mask",
        ),
        LayoutField(
            name="sample_log_probs",
            key=("log_probs", "full"),
            dtype="float32",
            shapes=(("B", "T"),),
            read_where="assistant_mask",
            meaning="behaviour-policy log p(token_t | tokens before t)",
        ),
        LayoutField(
            name="ref_log_probs",
            key=("next", "ref_log_probs", "full"),
            dtype="float32",
            shapes=(("B", "T"),),
            read_where="assistant_mask",
            meaning="reference-policy log-probs, same alignment",
        ),
        LayoutField(
            name="advantage",
            key=("advantage",),
            dtype="float32",
            shapes=(("B",), ("B", "T")),
            meaning="per-sequence or per-token advantage",
        ),
        LayoutField(
            name="reward",
            key=("next", "reward"),
            dtype="float32",
            shapes=(("B",),),
            meaning="per-sequence reward",
        ),
        LayoutField(
            name="policy_version",
            key=("policy_version",),
            dtype="int64",
            shapes=(("B",),),
            meaning="weights version that generated the sample",
        ),
        LayoutField(
            name="group_id",
            key=("group_id",),
            dtype="int64",
            shapes=(("B",),),
            meaning="GRPO group (same prompt)",
        ),
    ),
    implies=(("assistant_mask", "attention_mask"),),
)
"""The LLM layout v1: TorchRL's default keys, dtypes and shapes relative to batch dims.

Example:
    >>> LLM_LAYOUT_V1.key("assistant_mask"), LLM_LAYOUT_V1.field("tokens").dtype
    (('masks', 'all_assistant_mask'), 'int64')
"""
