"""The commands of ``mmlight`` outside LightningCLI, one module each: ``prepare``, ``analyze``, ``sweep``,
``collect`` and ``doctor``. Each holds its parser and ``main(argv)``; :data:`mmlight.cli.TOOLS` names them
and imports one only when it is run. They sit above every library layer and below :mod:`mmlight.cli`."""
