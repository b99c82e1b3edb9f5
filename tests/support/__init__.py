"""What the tests share: launchers (horovodrun, warm interpreters, hosts in network namespaces,
SLURM, Redis, a small disk), fixtures' builders, the recorded references and the workers that
horovodrun starts. No tests here."""
