"""The expert-load dashboard: one static page that polls {prefix}/data.json and draws with plotly."""
from moe.dashboard.server import add_dashboard_routes, build_dashboard_app

__all__ = ["add_dashboard_routes", "build_dashboard_app"]
