"""The side-effect firewall: external tools run here, in the daemon, through a write-ahead call ledger.

See `service.Firewall` for call identity, replay branches and timeout semantics.
"""

from sandboxd.firewall.adapters import (
    EffectAdapter,
    EffectNotDelivered,
    EffectOutcomeUnknown,
    HttpGetAdapter,
    HttpRequestAdapter,
    SmtpAdapter,
    WebhookAdapter,
)
from sandboxd.firewall.config import FirewallConfig, HttpConfig, SmtpConfig, WebhookConfig, parse_config
from sandboxd.firewall.intent import canonical_json, derive_call_id, intent_key
from sandboxd.firewall.ledger import CallRecord, HeldEffect, Ledger
from sandboxd.firewall.service import Firewall, FirewallResult, FirewallStats, ReplayReport

__all__ = [
    "CallRecord",
    "EffectAdapter",
    "EffectNotDelivered",
    "EffectOutcomeUnknown",
    "Firewall",
    "FirewallConfig",
    "FirewallResult",
    "FirewallStats",
    "HeldEffect",
    "HttpConfig",
    "HttpGetAdapter",
    "HttpRequestAdapter",
    "Ledger",
    "ReplayReport",
    "SmtpAdapter",
    "SmtpConfig",
    "WebhookAdapter",
    "WebhookConfig",
    "canonical_json",
    "derive_call_id",
    "intent_key",
    "parse_config",
]
