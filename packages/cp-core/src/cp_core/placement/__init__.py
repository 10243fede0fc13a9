"""Which rank holds which token: ShardLayout, runs, pad divisors, token verbs, verify."""
