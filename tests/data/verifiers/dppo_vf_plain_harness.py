"""A verifiers v1 harness written for dppo's tests: a chat program that asks the model once WITHOUT streaming (the
`null` harness streams), so verifiers' EvalClient relays a plain chat completion to the proxy."""

import verifiers.v1 as vf
from verifiers.v1.harnesses.utils.launch import launch_chat_program

PROGRAM = '''# /// script
# requires-python = ">=3.10"
# dependencies = ["openai"]
# ///
import argparse, json
from openai import OpenAI

parser = argparse.ArgumentParser()
for name in ("--base-url", "--api-key", "--model", "--prompt", "--system-prompt", "--initial-messages-file"):
    parser.add_argument(name)
args, _ = parser.parse_known_args()
messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
if args.initial_messages_file:
    messages += json.load(open(args.initial_messages_file))
elif args.prompt:
    messages.append({"role": "user", "content": args.prompt})
client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
reply = client.chat.completions.create(model=args.model, messages=messages)
print(reply.choices[0].message.content)
'''


class PlainHarnessConfig(vf.HarnessConfig):
    pass


class PlainHarness(vf.Harness[PlainHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def setup(self, runtime: vf.Runtime) -> None:
        await runtime.prepare_uv_script(PROGRAM, self.config.resolved_env)

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system_prompt, prompt = self.resolve_prompt(data)
        return await launch_chat_program(PROGRAM, self.config, ctx, trace, runtime, endpoint, secret, {},
                                         system_prompt, prompt)


__all__ = ["PlainHarness"]
