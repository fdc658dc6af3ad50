"""What a server adds around engines: one per tenant with byte caps (``tenants``), anchor pools
saved across restarts (``persist``), and the quality guard (dense twins of sampled calls) (``quality_guard``)."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.services.tenants": ("TenantRegistry", "TenantEngine", "tenant_label"),
    "kvcomm.services.persist": ("save_engine", "load_engine", "PersistError", "LoadSummary"),
    "kvcomm.services.quality_guard": ("QualityGuard", "GuardConfig"),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
