"""Example agents written against an OpenAI client, importing no dppo module (`dppo.episodes.examples.calculator`)."""
