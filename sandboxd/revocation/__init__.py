"""Revocation support: salted fingerprints of revoked values, injection detectors, leak scans, graph drawing.

The revocation operator itself (rewind and replay, DESIGN.md "Revocation") builds on these: a
detector raises the event, fingerprints keep a revoked value from re-entering, a leak scan checks
that forgetting was physical, and the graph shows the taint closure to an operator.
"""

from sandboxd.revocation.detector import Finding, InjectionDetector, RuleBasedDetector, load_detector
from sandboxd.revocation.fingerprint import RevokedFingerprint, excise, find, fingerprint
from sandboxd.revocation.leakscan import Hit, LeakReport, needles_for, scan_container, scan_images, scan_paths

__all__ = [
    "Finding",
    "Hit",
    "InjectionDetector",
    "LeakReport",
    "RevokedFingerprint",
    "RuleBasedDetector",
    "excise",
    "find",
    "fingerprint",
    "load_detector",
    "needles_for",
    "scan_container",
    "scan_images",
    "scan_paths",
]
