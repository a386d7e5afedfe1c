"""Metric families as plain data, so they cross process boundaries (Ray) unchanged, and the page.

A family is `{"name", "type", "help", "samples": [[sample name, {label: value}, value], ...]}`, taken
from what a prometheus_client registry collects (`families`). The router merges the families of its
replicas into one family per name, each sample labelled with its replica (`merge`), adds its own,
and `render`s the page with prometheus_client's encoders (text 0.0.4, or OpenMetrics when the
scraper asks for it), each family followed on the page by its vLLM twins (`vllm_metrics.twins`: vLLM's
names over the same samples). No registry here is the process-global default one: every app, replica and
scrape has its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric


def families(metrics: Iterable[Metric]) -> list[dict]:
    """prometheus_client families as plain data (the `_created` timestamps are left out)."""
    out = []
    for m in metrics:
        samples = [[s.name, dict(s.labels), float(s.value)] for s in m.samples if not s.name.endswith("_created")]
        out.append({"name": m.name, "type": m.type, "help": m.documentation, "samples": samples})
    return out


def merge(per_source: dict[str, list[dict]], label: str = "replica") -> list[dict]:
    """One family per name over several sources (replicas), each sample labelled `label`=source.
    Families keep the order they first appear in; a source whose family has another type is refused."""
    out: dict[str, dict] = {}
    for source, fams in per_source.items():
        for f in fams:
            m = out.setdefault(f["name"], {"name": f["name"], "type": f["type"], "help": f["help"], "samples": []})
            if m["type"] != f["type"]:
                raise ValueError(f"metric {f['name']}: {source} reports a {f['type']}, others a {m['type']}")
            m["samples"] += [[n, {label: source, **labels}, v] for n, labels, v in f["samples"]]
    return list(out.values())


class _Static:
    """A collector yielding given plain-data families."""

    def __init__(self, fams: list[dict]):
        self.fams = fams

    def collect(self) -> Iterable[Metric]:
        for f in self.fams:
            m = Metric(f["name"], f["help"], f["type"])
            for name, labels, value in f["samples"]:
                m.add_sample(name, labels, value)
            yield m


def render(fams: list[dict], accept: str | None = None) -> tuple[bytes, str]:
    """(page, content type) in the format the Accept header asks for (default: text 0.0.4): `fams` and
    their vLLM twins (`vllm_metrics.twins`)."""
    from .vllm_metrics import twins
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Static(fams + twins(fams)))
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
