"""Weight-name tables: how a file format's tensor names become twinfer's canonical names.
A table is a list of `Rule(source, target, transform)`: `source` with `{i}`, `{e}`, `{part}`, `{*}`
placeholders, `target` a canonical name (None drops it on purpose), `transform` a named entry of
`weights.TRANSFORMS` or the table's own. Canonical names and shapes: each `Model.weight_shapes`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from twinfer.runtime.errors import WeightError
from twinfer.runtime.loaders.weights import TRANSFORMS, StoredTensor, Transform, WeightEntry, WeightSet
from twinfer.runtime.spec import ModelSpec

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class Rule:
    source: str
    target: str | None
    transform: str | None = None


@dataclass(frozen=True)
class NameTable:
    """The rules of one architecture in one file format, with prefix `aliases`, `optional` names, and the
    architecture's own named `transforms`."""

    name: str
    rules: tuple[Rule, ...]
    aliases: tuple[tuple[str, str], ...] = ()
    optional: tuple[str, ...] = ()
    transforms: tuple[tuple[str, Transform], ...] = ()

    def __post_init__(self) -> None:
        own = dict(self.transforms)
        for rule in self.rules:
            if rule.transform is not None and rule.transform not in TRANSFORMS and rule.transform not in own:
                raise ValueError(f"rule {rule.source!r}: unknown transform {rule.transform!r}")

    def transform(self, name: str) -> Transform:
        return dict(self.transforms).get(name) or TRANSFORMS[name]

    def extended(self, name: str, rules: tuple[Rule, ...] = (), **changes: object) -> NameTable:
        """This table with more rules (and other fields changed), under a new name."""
        fields = {"aliases": self.aliases, "optional": self.optional, "transforms": self.transforms, **changes}
        return NameTable(name, self.rules + rules, **fields)  # type: ignore[arg-type]


def rule(source: str, target: str | None, transform: str | None = None) -> Rule:
    return Rule(source, target, transform)


def _compile(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"(\{i\}|\{e\}|\{part\}|\{\*\})", pattern)
    groups = {"{i}": r"(?P<i>\d+)", "{e}": r"(?P<e>\d+)", "{part}": r"(?P<part>[a-z]+)", "{*}": r".*"}
    return re.compile("".join(groups.get(p, re.escape(p)) for p in parts))


def map_weights(
    spec: ModelSpec, table: NameTable, stored: Mapping[str, StoredTensor], origin: str, expected: Shapes,
    skip: tuple[str, ...] = (),
) -> WeightSet:
    """Build the WeightSet of `spec` from the file's tensors; `expected` is every canonical weight the
    architecture needs, with its shape; tensors whose (aliased) name starts with a `skip` prefix are
    left unread. Raises WeightError naming the tensor when one matches no rule, a needed one is
    missing, or a shape disagrees with the spec."""
    compiled = [(_compile(rule.source), rule) for rule in table.rules]
    single: dict[str, WeightEntry] = {}
    experts: dict[tuple[str, str], dict[int, StoredTensor]] = {}  # (target, transform) -> e -> tensor
    parts: dict[tuple[str, str], dict[str, StoredTensor]] = {}  # (target, transform) -> part -> tensor
    for name, tensor in stored.items():
        key = _alias(name, table)
        if skip and key.startswith(skip):
            continue
        hits = [(m, rule) for regex, rule in compiled if (m := regex.fullmatch(key)) and _part_ok(m, rule, table)]
        if not hits:
            raise WeightError(f"unused tensor {name!r} in {origin}: no {table.name} weight maps to it")
        for m, rule in hits:
            if rule.target is None:
                continue
            target = rule.target.format(i=int(m["i"])) if "{i}" in rule.target else rule.target
            if rule.transform is not None and table.transform(rule.transform).many:
                experts.setdefault((target, rule.transform), {})[int(m["e"])] = tensor
            elif rule.transform is not None and table.transform(rule.transform).parts:
                parts.setdefault((target, rule.transform), {})[m["part"]] = tensor
            else:
                _add(single, target, _entry(table, (tensor,), rule.transform), origin)
    for (target, transform), by_expert in experts.items():
        _add(single, target, _stack(target, transform, by_expert, spec, table, origin), origin)
    for (target, transform), by_part in parts.items():
        _add(single, target, _packed(target, transform, by_part, table, origin), origin)
    return WeightSet(spec, _check(spec, table, single, origin, expected))


def _entry(table: NameTable, sources: tuple[StoredTensor, ...], transform: str | None) -> WeightEntry:
    return WeightEntry(sources, transform, None if transform is None else table.transform(transform))


def _part_ok(m: re.Match[str], rule: Rule, table: NameTable) -> bool:
    """A `{part}` match counts only for a part the rule's transform takes."""
    part = m.groupdict().get("part")
    return part is None or (rule.transform is not None and part in table.transform(rule.transform).parts)


def _alias(name: str, table: NameTable) -> str:
    for old, new in table.aliases:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _add(entries: dict[str, WeightEntry], target: str, entry: WeightEntry, origin: str) -> None:
    if target in entries:
        first, second = entries[target].sources[0].name, entry.sources[0].name
        raise WeightError(f"tensors {first!r} and {second!r} in {origin} both give {target!r}; remove one")
    entries[target] = entry


def _stack(
    target: str, transform: str, by_expert: dict[int, StoredTensor], spec: ModelSpec, table: NameTable,
    origin: str,
) -> WeightEntry:
    n = spec.moe.num_experts if spec.moe is not None else 0
    extra = sorted(e for e in by_expert if e >= n)
    if extra:
        raise WeightError(
            f"unused tensor {by_expert[extra[0]].name!r} in {origin}: the model has {n} experts"
        )
    missing = [e for e in range(n) if e not in by_expert]
    if missing:
        some = by_expert[min(by_expert)].name
        raise WeightError(
            f"missing tensor {target!r} expert {missing[0]} (expected next to {some!r}) in {origin}"
        )
    return _entry(table, tuple(by_expert[e] for e in range(n)), transform)


def _packed(
    target: str, transform: str, by_part: dict[str, StoredTensor], table: NameTable, origin: str
) -> WeightEntry:
    wanted = table.transform(transform).parts
    missing = [p for p in wanted if p not in by_part]
    if missing:
        some = next(iter(by_part.values())).name
        raise WeightError(f"missing tensor {target!r} part {missing[0]!r} (expected next to {some!r}) in {origin}")
    return _entry(table, tuple(by_part[p] for p in wanted), transform)


def _check(
    spec: ModelSpec, table: NameTable, entries: dict[str, WeightEntry], origin: str, expected: Shapes
) -> dict[str, WeightEntry]:
    out: dict[str, WeightEntry] = {}
    for target, entry in entries.items():
        if target not in expected:
            if target == "lm_head" and spec.tie_word_embeddings:
                continue  # a tied checkpoint that also saved the (identical) head
            if target not in table.optional:
                raise WeightError(
                    f"unused tensor {entry.sources[0].name!r} in {origin}: the model's config has no "
                    f"{target!r} weight"
                )
            out[target] = entry
            continue
        shape = entry.shape(spec)
        if shape != expected[target]:
            raise WeightError(
                f"tensor {entry.sources[0].name!r} in {origin} has shape {shape}, but the model's config "
                f"implies {expected[target]} for {target!r}"
            )
        out[target] = entry
    for target in expected:
        if target not in out:
            raise WeightError(
                f"missing tensor {target!r} (expected from {_source_hint(target, table)}) in {origin}"
            )
    return {name: out[name] for name in [*expected, *(n for n in out if n not in expected)]}


def _source_hint(target: str, table: NameTable) -> str:
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", target)
    layer, generic = (m[1], "layers.{i}." + m[2]) if m else (None, target)
    sources = [r.source for r in table.rules if r.target == generic]
    if layer is not None:
        sources = [s.replace("{i}", layer) for s in sources]
    return " or ".join(repr(s) for s in sources) or "no rule"
