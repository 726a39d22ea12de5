"""What a running gateway holds (:mod:`mmgate.gateway.state`), below the endpoints of ``api/``."""
