"""The declarative validator of config dataclasses (``diloco_core.config``): rules in field metadata, one loop."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest

from diloco_core import DiLoCoConfig
from diloco_core.rules import Rule, boolean, check_fields, choice, integer, number, rule, string
from diloco_train.data.corpus import DataConfig
from diloco_train.model import ModelConfig
from diloco_train.train_config import TrainConfig
from transports.inprocess import InProcessConfig
from transports.simulated_link import LinkConfig
from transports.torch.group import TorchDistConfig


@dataclass(frozen=True, kw_only=True)
class _Example:
    count: int = field(default=1, metadata=integer(low=1))
    limit: int = field(default=2, metadata=integer(low=0, high=lambda c: c.count + 1))
    ratio: float = field(default=0.5, metadata=number(gt=0, le=1))
    scale: float | None = field(default=None, metadata=number(ge=1, lt=4, noun="a finite number", unset=True))
    mode: str = field(default="a", metadata=choice(("b", "a")))
    flag: bool = field(default=True, metadata=boolean())
    name: str = field(default="x", metadata=string(empty=False))
    even: int = field(default=0, metadata=rule(lambda v: v % 2 == 0, "an even number"))
    free: object = None

    def __post_init__(self) -> None:
        check_fields(self)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"count": 0}, "count=0 is invalid: expected an integer >= 1"),
        ({"count": True}, "count=True is invalid: expected an integer >= 1"),  # a bool is no integer here
        ({"count": 2.0}, "count=2.0 is invalid: expected an integer >= 1"),
        ({"limit": 3}, "limit=3 is invalid: expected an integer in [0, 2]"),  # the bound is count + 1
        ({"count": 3, "limit": 5}, "limit=5 is invalid: expected an integer in [0, 4]"),
        ({"ratio": 0}, "ratio=0 is invalid: expected a number in (0, 1]"),  # an open end
        ({"ratio": math.nan}, "ratio=nan is invalid: expected a number in (0, 1]"),
        ({"ratio": False}, "ratio=False is invalid: expected a number in (0, 1]"),
        ({"scale": 4}, "scale=4 is invalid: expected a finite number in [1, 4) (or unset)"),
        ({"scale": math.inf}, "scale=inf is invalid: expected a finite number in [1, 4) (or unset)"),
        ({"mode": "c"}, "mode='c' is invalid: expected one of ['b', 'a']"),
        ({"mode": ["a"]}, "mode=['a'] is invalid: expected one of ['b', 'a']"),  # unhashable: still a ValueError
        ({"flag": 1}, "flag=1 is invalid: expected true or false"),
        ({"name": ""}, "name='' is invalid: expected a non-empty string"),
        ({"even": 3}, "even=3 is invalid: expected an even number"),
        ({"count": 0, "ratio": 0}, "count=0 is invalid"),  # the first invalid field in field order
    ],
)
def test_a_rule_names_the_field_the_value_and_the_range(values: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        _Example(**values)
    assert str(e.value).startswith(message)


@pytest.mark.timeout(30)
def test_valid_values_pass_at_the_closed_ends_and_unset() -> None:
    _Example(count=1, limit=2, ratio=1, scale=1, mode="b", flag=False, name="n", even=-2, free=object())
    _Example(scale=None, limit=0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "cls",
    [DiLoCoConfig, TrainConfig, ModelConfig, DataConfig, InProcessConfig, LinkConfig, TorchDistConfig],
)
def test_every_config_declares_its_fields_rules(cls: type) -> None:
    """Every field of a config dataclass carries a rule, but for the few checked by hand after the loop."""
    # the alias of codec; the block's check (diloco_core.codecs.block); a secret (its value is never shown)
    by_hand = {"wire_dtype", "codec_block", "secret"}
    unruled = [f.name for f in dataclasses.fields(cls) if not isinstance(f.metadata.get("rule"), Rule)]
    assert not [name for name in unruled if name not in by_hand], unruled
