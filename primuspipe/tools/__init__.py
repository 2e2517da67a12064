"""Tools built on primuspipe's core: pp_vis (timeline drawing, real vs simulated comparison)."""
