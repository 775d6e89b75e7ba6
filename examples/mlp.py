"""The built-in CPU example for `make demo`: an MLP trained for a few steps
through torch.compile, plus a model exported ahead of time.

    rewritec compile examples/mlp.py
"""

import torch
import torch.nn.functional as F

torch.manual_seed(0)


class MLP(torch.nn.Module):
    def __init__(self, d_in: int = 64, d_hidden: int = 256, d_out: int = 10) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.norm = torch.nn.LayerNorm(d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.fc1(x)))
        # A deliberately redundant tail the simplifier should clean up.
        h = (h * 1.0 + 0.0) * (torch.sin(h) ** 2 + torch.cos(h) ** 2)
        return F.log_softmax(self.fc2(h), dim=-1)


model = MLP()
example_inputs = (torch.randn(32, 64),)

# A short training loop through torch.compile: forward and backward graphs.
train_model = MLP()
opt = torch.optim.SGD(train_model.parameters(), lr=0.05)
step = torch.compile(train_model)
x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
for i in range(5):
    loss = F.nll_loss(step(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {i}: loss {loss.item():.4f}")
