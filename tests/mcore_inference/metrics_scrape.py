"""``/metrics`` of a live server, parsed with ``prometheus_client``'s own parser."""

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict:
    """``{(sample name, sorted labels): value}`` of ``/metrics``, parsed by prometheus_client."""
    body = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }
