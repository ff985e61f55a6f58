"""Build a Topology from a SLURM allocation plus a small file that maps hostnames to data centres.

SLURM numbers ranks node by node in SLURM_JOB_NODELIST order (block distribution), so the DCs must
appear as contiguous runs of hosts in that list and each DC must have the same number of nodes: the
resulting levels are dc > node > gpu (tasks per node).

The DC map is YAML::

    datacenters:            # DC name -> hostname glob patterns (fnmatch: *, ?, [0-7])
      east: ["gpu-0[1-4]", "east-*"]
      west: ["gpu-0[5-8]"]
    levels:                 # optional link parameters per level (counts come from the allocation)
      dc:   {bandwidth_gbps: 10, latency_us: 2000, uplink_gbps: 10}
      node: {bandwidth_gbps: 100, latency_us: 5}
      gpu:  {bandwidth_gbps: 128, latency_us: 2, uplink_gbps: 128}

or plain text, one ``PATTERN DC`` per line (``#`` starts a comment); link parameters then come from a
topology YAML (``links`` argument) whose levels are named dc, node, gpu.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.fields import FieldReader, load_yaml
from megatron_hybridep.plan.topology import Level, Topology, level_from_dict

LEVEL_NAMES = ("dc", "node", "gpu")


# ---- SLURM hostlists -------------------------------------------------------------------------------
def _split_top(s: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise PlanError(f"SLURM_JOB_NODELIST: unbalanced ']' in {s!r}; fix: pass the value SLURM set")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise PlanError(f"SLURM_JOB_NODELIST: unbalanced '[' in {s!r}; fix: pass the value SLURM set")
    parts.append("".join(cur))
    return [p for p in (p.strip() for p in parts) if p]


def _expand_range(body: str, whole: str) -> list[str]:
    out = []
    for item in body.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise PlanError(f"SLURM_JOB_NODELIST: bad range {item!r} in {whole!r}; fix: use forms like "
                            "node[01-04,07]")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise PlanError(f"SLURM_JOB_NODELIST: descending range {item!r} in {whole!r}; fix: write lo-hi")
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0  # SLURM keeps lo's zero-padding
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist: ``"gpu-[01-04,07],cpu5"`` -> gpu-01 .. gpu-04, gpu-07, cpu5.

    Several bracket groups in one name expand as a product (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2),
    in SLURM's order (the last group varies fastest). Order and duplicates are kept as given."""
    hosts: list[str] = []
    for part in _split_top(nodelist.strip()):
        pieces = re.split(r"(\[[^\]]*\])", part)
        names = [""]
        for piece in pieces:
            if piece.startswith("["):
                options = _expand_range(piece[1:-1], nodelist)
                names = [n + o for n in names for o in options]
            elif "[" in piece or "]" in piece:
                raise PlanError(f"SLURM_JOB_NODELIST: bad brackets in {part!r}; fix: pass the value SLURM set")
            else:
                names = [n + piece for n in names]
        hosts.extend(names)
    if not hosts:
        raise PlanError("SLURM_JOB_NODELIST: empty; fix: run inside a SLURM allocation or set it")
    return hosts


def parse_tasks_per_node(value: str) -> list[int]:
    """SLURM_TASKS_PER_NODE (``"8(x2),4"``) or SLURM_NTASKS_PER_NODE (``"8"``) -> per-node counts."""
    out: list[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise PlanError(f"SLURM_TASKS_PER_NODE: cannot parse {value!r}; fix: expected forms like "
                            "'8' or '8(x4)'")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


# ---- DC maps ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DCMap:
    """Ordered (pattern, dc) rules; the first matching pattern wins. Optional link parameters per level."""

    rules: tuple[tuple[str, str], ...]
    levels: Mapping[str, Any] | None = None
    source: str = "dc map"

    def dc_of(self, host: str) -> str:
        for pattern, dc in self.rules:
            if fnmatch.fnmatchcase(host, pattern):
                return dc
        raise PlanError(f"{self.source}: host {host!r} matches no pattern; fix: add a pattern for it "
                        f"(patterns: {', '.join(p for p, _ in self.rules)})")


def load_dc_map(path: str) -> DCMap:
    if path.endswith((".yaml", ".yml")):
        r = FieldReader(load_yaml(path), path)
        dcs = r.raw("datacenters")
        levels = r.raw("levels", None)
        r.done()
        if not isinstance(dcs, Mapping) or not dcs:
            raise PlanError(f"{path}.datacenters: expected a mapping DC name -> list of host patterns")
        rules = []
        for dc, patterns in dcs.items():
            if isinstance(patterns, str):
                patterns = [patterns]
            if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
                raise PlanError(f"{path}.datacenters.{dc}: expected a list of hostname patterns")
            rules.extend((p, str(dc)) for p in patterns)
        if levels is not None and not isinstance(levels, Mapping):
            raise PlanError(f"{path}.levels: expected a mapping level name -> link parameters")
        return DCMap(tuple(rules), levels, path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise PlanError(f"{path}: DC map not found; fix: pass an existing file") from None
    rules = []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise PlanError(f"{path}:{i}: expected 'HOST_PATTERN DC_NAME', got {line!r}")
        rules.append((fields[0], fields[1]))
    if not rules:
        raise PlanError(f"{path}: no 'HOST_PATTERN DC_NAME' lines; fix: add one per DC")
    return DCMap(tuple(rules), None, path)


# ---- SLURM -> Topology ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SlurmLayout:
    hosts: tuple[str, ...]
    dcs: tuple[str, ...]            # DC names in rank order
    nodes_per_dc: int
    tasks_per_node: int


def slurm_layout(dc_map: DCMap, env: Mapping[str, str] | None = None) -> SlurmLayout:
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise PlanError("SLURM_JOB_NODELIST: not set; fix: run inside a SLURM allocation (salloc/sbatch) "
                        "or pass --topology with a YAML file")
    hosts = expand_nodelist(nodelist)
    if len(set(hosts)) != len(hosts):
        raise PlanError("SLURM_JOB_NODELIST: a host appears twice; fix: pass the value SLURM set")
    if env.get("SLURM_NTASKS_PER_NODE"):
        tpn = parse_tasks_per_node(env["SLURM_NTASKS_PER_NODE"])
        per_node = tpn * len(hosts) if len(tpn) == 1 else tpn
    elif env.get("SLURM_TASKS_PER_NODE"):
        per_node = parse_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
    else:
        raise PlanError("SLURM_NTASKS_PER_NODE: not set; fix: submit with --ntasks-per-node=<GPUs per node>")
    if len(per_node) != len(hosts):
        raise PlanError(f"SLURM_TASKS_PER_NODE: {len(per_node)} entries for {len(hosts)} hosts; "
                        "fix: pass the values SLURM set for this allocation")
    if len(set(per_node)) != 1 or per_node[0] < 1:
        raise PlanError(f"SLURM_NTASKS_PER_NODE: tasks per node differ ({per_node}); fix: use the same "
                        "--ntasks-per-node on every node (HybridEP needs a regular grid)")
    dcs: list[str] = []
    runs: dict[str, int] = {}
    for host in hosts:
        dc = dc_map.dc_of(host)
        if dcs and dcs[-1] == dc:
            runs[dc] += 1
            continue
        if dc in runs:
            raise PlanError(f"{dc_map.source}: hosts of DC {dc!r} are not contiguous in SLURM_JOB_NODELIST "
                            f"(host {host!r} comes after another DC's hosts); ranks would not be DC-major. "
                            "fix: order the allocation by DC (e.g. sbatch --nodelist in DC order) or "
                            "correct the patterns")
        dcs.append(dc)
        runs[dc] = 1
    if len(set(runs.values())) != 1:
        raise PlanError(f"{dc_map.source}: DCs have different node counts "
                        f"({', '.join(f'{d}={n}' for d, n in runs.items())}); fix: allocate the same "
                        "number of nodes in every DC")
    return SlurmLayout(tuple(hosts), tuple(dcs), runs[dcs[0]], per_node[0])


def topology_from_slurm(dc_map: DCMap | str, links: Topology | str | None = None,
                        env: Mapping[str, str] | None = None) -> Topology:
    """dc > node > gpu topology with counts from SLURM, links from the DC map's ``levels`` or ``links``."""
    if isinstance(dc_map, str):
        dc_map = load_dc_map(dc_map)
    if isinstance(links, str):
        links = Topology.from_yaml(links)
    lay = slurm_layout(dc_map, env)
    counts = {"dc": len(lay.dcs), "node": lay.nodes_per_dc, "gpu": lay.tasks_per_node}
    source = f"slurm({dc_map.source})"
    if dc_map.levels is not None:
        unknown = set(dc_map.levels) - set(LEVEL_NAMES)
        if unknown:
            raise PlanError(f"{dc_map.source}.levels.{sorted(unknown)[0]}: unknown level; fix: use dc, node, gpu")
        missing = [n for n in LEVEL_NAMES if n not in dc_map.levels]
        if missing:
            raise PlanError(f"{dc_map.source}.levels.{missing[0]}: missing link parameters; "
                            "fix: give bandwidth_gbps (and latency_us) for dc, node and gpu")
        levels: list[Level] = []
        for n in LEVEL_NAMES:
            spec = dict(dc_map.levels[n] or {})
            spec.setdefault("name", n)
            levels.append(level_from_dict(spec, f"{dc_map.source}.levels.{n}", count=counts[n]))
        return Topology(tuple(levels), name=f"slurm:{','.join(lay.dcs)}", source=source)
    if links is None:
        raise PlanError(f"{dc_map.source}: no link parameters; fix: add a 'levels:' block to the YAML DC map "
                        "or pass a topology YAML with levels dc, node, gpu for the link speeds")
    if links.level_names != LEVEL_NAMES:
        raise PlanError(f"{links.source}.levels: SLURM topologies have levels {LEVEL_NAMES}, the link file has "
                        f"{links.level_names}; fix: name its levels dc, node, gpu")
    return links.with_counts([counts[n] for n in LEVEL_NAMES], source=source)
