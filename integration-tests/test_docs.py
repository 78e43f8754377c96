"""/docs works without network: the page and everything it loads come from the router."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import PurePosixPath
from urllib.parse import urljoin, urlsplit

import httpx

# What each kind of file the page loads must be served as.
CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css", ".json": "application/json"}


class _References(HTMLParser):
    """Every src= and href= of a page, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found += [value for name, value in attrs if name in ("src", "href") and value]


def test_docs_and_everything_it_loads_come_from_the_router(client: httpx.Client) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text
    parser = _References()
    parser.feed(page.text)
    references = parser.found
    # `cadence launch` found Swagger UI in the installed package: the page is Swagger UI
    assert "/docs/assets/swagger-ui-bundle.js" in references, page.text
    assert "/docs/assets/swagger-ui.css" in references, page.text
    for reference in references:
        parts = urlsplit(reference)
        assert not parts.scheme and not parts.netloc, f"{reference} leaves the server"
        if not parts.path:  # a fragment within the page
            continue
        fetched = client.get(urljoin("/docs", reference))
        assert fetched.status_code == 200, reference
        expected = CONTENT_TYPES[PurePosixPath(parts.path).suffix]
        assert fetched.headers["content-type"].startswith(expected), (reference, fetched.headers)
        assert fetched.content, reference
    # the page's inline script loads the document: Swagger UI 5 reads its OpenAPI 3.1
    assert '"/openapi.json"' in page.text
    document = client.get("/openapi.json").json()
    assert document["openapi"].startswith("3.1")
