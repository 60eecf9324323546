"""Long runs: `rss` (server memory growth over a soak), `watchdog` (progress or a named hang)."""
