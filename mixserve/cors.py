"""Which web pages may call the server from a browser (CORS), with vLLM's four flags.

A browser sends `Origin` with every cross-origin request, and asks first (a preflight: OPTIONS with
`Access-Control-Request-Method`) before a JSON POST. The server answers a page only if its origin
is allowed, and refuses (403) any request from an origin that is not, before it acts: a page may
POST a form-encoded or text/plain body with no preflight, which this server would read as JSON,
so leaving out the CORS headers alone would still let any page a user visits drive
/update_weights_from_disk or /sleep. Clients that are not browsers (curl, SDKs, a notebook's
Python) send no Origin and are not affected.

vLLM allows every origin by default. Here the default allows none, so that a server on
localhost is not open to every page in the user's browser: `--allowed-origins '["*"]'` is vLLM's.
"""

from __future__ import annotations

import dataclasses

# The CORS-safelisted request headers (content-type only with form or text values): always allowed, as Starlette does.
SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})
PREFLIGHT_MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer (Starlette's default)


@dataclasses.dataclass(frozen=True)
class CorsPolicy:
    """origins / methods / headers: the allowed ones, "*" for any; credentials: whether pages may
    send cookies or HTTP authentication with their requests (then "*" is answered with the page's
    own origin, since browsers refuse "*" beside credentials)."""
    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def refusal(self, origin: str | None) -> str | None:
        """Why a request from this Origin (None: none sent, not a browser's cross-origin request) is
        refused; None if it is not."""
        if origin is None or "*" in self.origins or origin in self.origins:
            return None
        allowed = f"allows only {list(self.origins)}" if self.origins else "allows none"
        return (f"cross-origin request from {origin} refused: the server's --allowed-origins {allowed} "
                f"(e.g. --allowed-origins '[\"{origin}\"]')")

    def response_headers(self, origin: str | None) -> dict[str, str]:
        """The CORS headers of a response to an allowed request (none without an Origin)."""
        if origin is None:
            return {}
        if "*" in self.origins and not self.credentials:
            return {"Access-Control-Allow-Origin": "*"}
        # the answer names the page, so caches must keep one per Origin
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
                **({"Access-Control-Allow-Credentials": "true"} if self.credentials else {})}

    def preflight(self, origin: str, method: str, headers: str, served_methods: tuple[str, ...]) -> tuple[str | None, dict]:
        """A preflight's answer: (why it is refused, or None; the headers of an allowed one).
        method / headers: its Access-Control-Request-Method and -Headers (comma-separated);
        served_methods: what the server takes, named when any method is allowed."""
        if (why := self.refusal(origin)) is not None:
            return why, {}
        if "*" not in self.methods and method not in self.methods:
            return f"CORS preflight: method {method} is not among --allowed-methods {list(self.methods)}", {}
        asked = [h.strip() for h in headers.split(",") if h.strip()]
        own = {h.lower() for h in self.headers}
        if "*" not in own and (others := [h for h in asked if h.lower() not in own | SAFELISTED_HEADERS]):
            return f"CORS preflight: headers {others} are not among --allowed-headers {list(self.headers)}", {}
        answer = {**self.response_headers(origin),
                  "Access-Control-Allow-Methods": ", ".join(served_methods if "*" in self.methods else self.methods),
                  "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)}
        # with a list, the safelisted ones it asked for too: a JSON POST asks for content-type, and must see it named
        named = asked if "*" in own else [*self.headers, *(h for h in asked if h.lower() in SAFELISTED_HEADERS - own)]
        if named:
            answer["Access-Control-Allow-Headers"] = ", ".join(named)
        return None, answer
