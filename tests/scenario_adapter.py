"""The base of the scenarios' adapters (mirrored's in the parity tests, TensorFlow's in tests/data's recorders):
a subclass names its library's MirroredStrategy and constant; a strategy of n CPU replicas is made once."""


class ScenarioAdapter:
    MirroredStrategy = None  # the library's class

    def __init__(self):
        self._strategies = {}

    def new_strategy(self, n):
        return self.MirroredStrategy([f"/cpu:{i}" for i in range(n)])

    def strategy(self, n):
        if n not in self._strategies:
            self._strategies[n] = self.new_strategy(n)
        return self._strategies[n]
