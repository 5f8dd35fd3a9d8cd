"""An emulated cluster of hosts on one machine: network namespaces and tc rate limits."""
