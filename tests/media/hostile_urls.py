"""Hostile media URLs shared by the fetcher tests and the HTTP SSRF tests."""

from __future__ import annotations

PUBLIC = "93.184.216.34"  # a global unicast address; never dialled (test socket layers route it to loopback)

#: hosts that all mean this machine, in every spelling a C resolver or a URL parser accepts
LOOPBACK_HOSTS = [
    "127.0.0.1", "127.0.0.1.", "localhost", "LOCALHOST", "localhost.", "2130706433", "0x7f000001", "0x7F000001",
    "0177.0.0.1", "017700000001", "0x7f.1", "127.1", "127.0.1", "0.0.0.0", "0", "[::1]", "[::]",
    "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[0:0:0:0:0:ffff:7f00:1]", "[::127.0.0.1]", "[64:ff9b::7f00:1]",
    "[2002:7f00:1::]",
]

#: (URL, fake DNS table): private, link-local, CGNAT and metadata targets, numeric and by name
NON_PUBLIC_URLS = [
    ("http://10.0.0.1/a.png", {}),
    ("http://172.16.5.4/a.png", {}),
    ("http://192.168.1.1/a.png", {}),
    ("http://169.254.169.254/latest/meta-data/", {}),
    ("http://2852039166/latest/meta-data/", {}),  # 169.254.169.254 in decimal
    ("http://0xa9fea9fe/latest/meta-data/", {}),  # ... in hex
    ("http://0xa9.0xfe.0xa9.0xfe/", {}),
    ("http://[::ffff:169.254.169.254]/", {}),
    ("http://[::ffff:a9fe:a9fe]/", {}),
    ("http://[64:ff9b::a9fe:a9fe]/", {}),  # NAT64 of the metadata address
    ("http://[2002:a9fe:a9fe::1]/", {}),  # 6to4 of the metadata address
    ("http://[fd00:ec2::254]/", {}),  # AWS IMDS over IPv6
    ("http://[fe80::1]/", {}),
    ("http://[fc00::1]/", {}),
    ("http://100.64.0.1/", {}),  # carrier-grade NAT
    ("http://100.100.100.200/", {}),  # Alibaba metadata
    ("http://metadata.google.internal/computeMetadata/v1/", {"metadata.google.internal": ["169.254.169.254"]}),
    ("http://internal.test/a.png", {"internal.test": ["10.1.2.3"]}),
    ("http://cgnat.test/a.png", {"cgnat.test": ["100.64.7.7"]}),
    ("http://mapped.test/a.png", {"mapped.test": ["::ffff:10.0.0.1"]}),
    ("http://linklocal6.test/a.png", {"linklocal6.test": ["fe80::1"]}),
    ("http://mixed.test/a.png", {"mixed.test": [PUBLIC, "10.0.0.5"]}),  # one bad answer spoils the name
    ("http://zero.test/a.png", {"zero.test": ["0.0.0.0"]}),
]
