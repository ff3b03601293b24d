"""`rl -m`: a sweep's points sharing one warmed-up base (`base`) or one inference service
(`shared`), and their comparison (`summary`)."""
