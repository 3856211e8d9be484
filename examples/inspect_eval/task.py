"""An inspect_ai task whose tools run in a dsec sandbox: ``bash()`` and ``python()``.

The model is scripted (inspect's ``mockllm`` with custom outputs), so this runs without
any model API: it calls ``bash`` (which prints 6*7, the sandbox's kernel and a variable of
its environment, and writes ``answer.txt``), then ``python`` (which reads that file), then
answers; the scorer reads ``answer.txt`` through the sandbox. The sandbox is what
``dsec.yaml`` beside this file says (tier, image, environment).

Run against a server (``dsec serve``; ``$DSEC_URL`` and ``$DSEC_API_KEY`` select it), with
``dsec[integrations]`` installed (it registers the ``dsec`` sandbox provider)::

    cd examples/inspect_eval && inspect eval task.py
    inspect sandbox cleanup dsec        # what an eval that died left, for this key
"""

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Scorer, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate, use_tools
from inspect_ai.tool import bash, python
from inspect_ai.util import sandbox

BASH = "echo bash-says $((6*7)) $(uname -r) $INSPECT_MARK; echo found > answer.txt"
PYTHON = (
    "import os\n"
    "print('python-says', 6 * 7, os.environ['INSPECT_MARK'], open('answer.txt').read().strip())"
)
OUTPUTS = [
    ModelOutput.for_tool_call("mockllm/model", "bash", {"command": BASH}),
    ModelOutput.for_tool_call("mockllm/model", "python", {"code": PYTHON}),
    ModelOutput.from_content("mockllm/model", "done"),
]
for output in OUTPUTS:  # else mockllm counts tokens with tiktoken, which downloads its tables
    output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)


@scorer(metrics=[accuracy()])
def answer_file() -> Scorer:
    """Correct when the sandbox's ``answer.txt`` holds the target."""

    async def score(state: TaskState, target: Target) -> Score:
        text = (await sandbox().read_file("answer.txt")).strip()
        return Score(value=CORRECT if text == target.text else INCORRECT, answer=text)

    return score


@task
def tools_in_dsec() -> Task:
    return Task(
        dataset=[Sample(input="Use the tools.", target="found")],
        solver=[use_tools([bash(timeout=120), python(timeout=120)]), generate()],
        scorer=answer_file(),
        sandbox=("dsec", "dsec.yaml"),
        model=get_model("mockllm/model", custom_outputs=OUTPUTS),
    )
