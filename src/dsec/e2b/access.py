"""Who may talk to which sandbox, and which dsec image an E2B template names.

envd access tokens
    The SDK sends the control-plane key (``X-API-Key``) only to the control
    plane. In-sandbox requests carry ``E2b-Sandbox-Id`` and the
    ``envdAccessToken`` the control plane returned at create/connect time (as
    ``X-Access-Token``). dsec issues that token statelessly: it binds the
    sandbox id to the owner with an HMAC-SHA256 under a server secret, so any
    apiserver replica holding the secret can check it without a lookup. A token
    for sandbox A presented with ``E2b-Sandbox-Id: B`` does not verify, so
    another owner's sandbox is never reachable (answered as "not found").

signed file URLs
    ``sbx.download_url(path)`` / ``upload_url(path)`` are built by the SDK as
    ``<sandbox url>/files?path=..&signature=v1_<sha256(path:op:user:token[:exp])>``
    with no sandbox id in them. :meth:`AccessTokens.find_signed` finds the sandbox
    by checking the signature against the tokens issued by this process (the last
    :data:`MAX_REMEMBERED_SANDBOXES` sandboxes; after a restart, ``connect()`` or
    ``get_info()`` re-issues one).

templates
    ``template_id`` is resolved by :class:`TemplateMap`: an explicit alias table
    (``base`` -> ``e2b-base`` by default), otherwise the template is taken as a
    dsec image name. ``<tier>/<image>`` (e.g. ``microvm/debian``) picks a tier;
    without it the default tier is used.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from pydantic import ValidationError

from dsec.errors import ImageNotFound
from dsec.models import ImageRef
from dsec.tiers import get_tier

__all__ = [
    "DEFAULT_TEMPLATE_ALIASES",
    "AccessTokens",
    "TemplateMap",
    "TemplateTarget",
    "image_ref",
]

DEFAULT_TEMPLATE_ALIASES: dict[str, str] = {
    "base": "e2b-base",
    "code-interpreter-v1": "code-interpreter",
    "code-interpreter": "code-interpreter",
}
"""E2B's public template names mapped to dsec images (``e2b-base``: E2B's base template, with
the user ``user`` in ``/home/user``). Any other name is looked up as an image."""


def image_ref(name: str) -> ImageRef:
    """The request of an image verb about ``name`` (a template or snapshot name from an E2B
    URL): a name no image can have is ``ImageNotFound``, as the edge says of one it lacks."""
    try:
        return ImageRef(name=name)
    except ValidationError:
        raise ImageNotFound(f"image {name!r} not found") from None


MAX_REMEMBERED_SANDBOXES = 10_000
"""Sandboxes whose signed file URLs :meth:`AccessTokens.find_signed` can resolve."""


class AccessTokens:
    """Issue and verify envd access tokens (``<owner, base64url>.<hmac hex>``).

    Args:
        secret: HMAC key. Give every apiserver replica the same one so tokens
            survive restarts and work across replicas; ``None`` draws a random
            32-byte key (tokens then die with the process; ``connect()`` issues
            a fresh one).
    """

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        # sandbox id -> (owner, token, as bytes), most recently issued last
        self._issued: OrderedDict[str, tuple[str, bytes]] = OrderedDict()

    def _mac(self, sandbox_id: str, owner: str) -> str:
        msg = f"e2b-envd\0{sandbox_id}\0{owner}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def issue(self, sandbox_id: str, owner: str) -> str:
        """The token for ``owner`` to reach ``sandbox_id``'s in-sandbox API."""
        token = self._token(sandbox_id, owner)
        self._issued[sandbox_id] = (owner, token.encode())
        self._issued.move_to_end(sandbox_id)
        while len(self._issued) > MAX_REMEMBERED_SANDBOXES:
            self._issued.popitem(last=False)
        return token

    def _token(self, sandbox_id: str, owner: str) -> str:
        owner_b64 = base64.urlsafe_b64encode(owner.encode()).decode().rstrip("=")
        return f"{owner_b64}.{self._mac(sandbox_id, owner)}"

    def find_signed(
        self,
        path: str,
        operation: str,
        user: str,
        signature: str,
        expiration: int | None,
        *,
        sandbox_id: str | None = None,
    ) -> tuple[str, str] | None:
        """``(sandbox_id, owner)`` whose token made ``signature`` (E2B's v1 file-URL
        signature of ``path``, ``operation`` ``read``/``write``, ``user`` (``""``: default)
        and ``expiration`` (Unix seconds, ``None``: never)); ``None`` if no remembered
        sandbox (only ``sandbox_id`` when given) matches. Whether the URL expired is the
        caller's check, made after this one (as envd: a forger never learns the expiry was
        the problem)."""
        # "v1_" + unpadded base64 of a SHA-256: anything else matches no token
        if not signature.startswith("v1_") or len(signature) != 46:
            return None
        try:
            wanted = base64.b64decode(signature[3:] + "=", validate=True)
        except (binascii.Error, ValueError):
            return None
        candidates = (
            [(sandbox_id, self._issued[sandbox_id])]
            if sandbox_id is not None and sandbox_id in self._issued
            else ([] if sandbox_id is not None else list(self._issued.items()))
        )
        # Without a sandbox id every remembered token is tried (the SDK's URLs carry none):
        # one SHA-256 over the shared prefix, then a copy per token (~1 us each)
        prefix = hashlib.sha256(f"{path}:{operation}:{user}:".encode())
        tail = f":{expiration}".encode() if expiration is not None else b""
        for sid, (owner, token) in candidates:
            h = prefix.copy()
            h.update(token + tail)
            if hmac.compare_digest(h.digest(), wanted):
                return sid, owner
        return None

    def verify(self, sandbox_id: str, token: str) -> str | None:
        """The owner the token was issued to for ``sandbox_id``, or ``None``."""
        owner_b64, sep, mac = token.partition(".")
        if not sep or len(mac) != 64 or len(owner_b64) > 1024:
            return None
        try:
            owner = base64.urlsafe_b64decode(owner_b64 + "=" * (-len(owner_b64) % 4)).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        if not hmac.compare_digest(mac, self._mac(sandbox_id, owner)):
            return None
        return owner


@dataclass(frozen=True)
class TemplateTarget:
    """Where an E2B template lands in dsec: a tier and an image name."""

    tier: str
    image: str


@dataclass
class TemplateMap:
    """Resolve E2B template ids to dsec (tier, image).

    Args:
        aliases: template name -> dsec image name.
        default_tier: tier used when the template does not start with ``<tier>/``.
    """

    aliases: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_TEMPLATE_ALIASES))
    default_tier: str = "container"

    def resolve(self, template_id: str) -> TemplateTarget:
        """Split ``[<tier>/]<name>`` and apply the alias table (the edge checks the image exists)."""
        tier = self.default_tier
        name = template_id.strip()
        head, sep, rest = name.partition("/")
        if sep and get_tier(head) is not None:
            tier, name = head, rest
        return TemplateTarget(tier=tier, image=self.aliases.get(name, name))
